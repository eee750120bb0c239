"""What runs in a worker process, one per model: the only code that loads llama.cpp.

    loop        the worker: its engine and io threads, the message protocol, the token
    engine      the Backend behind it: in-place residency (the arbiterd engine build) or reload
    residency   the model's residency state machine (an Enum and a transition table)
    policy      when a warm model releases the GPU: a pure function

Imports the shared modules (arbiterd/*.py) and arbiterd.native, never the daemon, the CLI or
the tray (ruff's banned-api rule in this folder's ruff.toml says so).
"""
