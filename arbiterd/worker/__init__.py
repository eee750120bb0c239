"""What runs in a worker process, one per model: the only code that loads llama.cpp.

    __main__    `python -m arbiterd.worker --fd N --config JSON`: how the daemon starts a worker
    loop        the worker: the engine thread's steps, the message protocol
    inbox       the io thread and the commands it queues for the engine thread
    tenancy     the model's residency, its token and the moves between (load, warm, cool)
    gateway     the way to the GPU: the arena or group gate, the token held, a wait measured
    unavailable  a model that cannot be served: the stand-in backend, answers until it loads
    engine/     the Backend behind it: in-place residency (the arbiterd engine build) or reload
    residency   the model's residency state machine (an Enum and a transition table)
    policy      when a warm model releases the GPU: a pure function
    progress    the engine thread's beat, and its progress through a long native call
    choices     one choice of a completion, from the engine's text to OpenAI's chunks
    toolcalls   tool calls between OpenAI's fields and a model's text
    vision      the projector (libmtmd), loaded just in time, and images turned into embeddings
    kvfile      the state file an unloaded model's prompt cache waits in
    keptkv      that prompt cache saved at an unload and adopted by the next worker

Imports the shared modules (arbiterd/*.py) and arbiterd.native, never the daemon, the CLI or
the tray (ruff's banned-api rule in this folder's ruff.toml says so).
"""
