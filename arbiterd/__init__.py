"""arbiterd: share one GPU between several resident llama.cpp models and other GPU programs.

The package is laid out by process; each folder's ruff.toml bans the imports that would cross a
boundary (docs/architecture.md draws the processes). The folders:

    arena/        the GPU token: flock(2) locks, the queue, groups, a model's several devices
    daemon/       the daemon process, in rooms by role (never llama.cpp)
    worker/       one process per model: the only code, with rpcserver/, that loads llama.cpp
    rpcserver/    `arbiterd rpc-server`: an engine process serving this machine's devices
    native/       ctypes handles on the engine's own libraries (the residency patch, ggml)
    cli/          the `arbiterd` command, in the user's shell
    gui/          the tray app: only a client of the control socket
    lease/        lending a GPU over RPC and taking it back: the channel, the lender's side
                  (in rpc-server), the borrower's (in the daemon)

and the modules every process shares:

    __main__      `python -m arbiterd`
    states        the vocabulary: states, ops, commands, kinds, classes and reasons as Enums,
                  and their transitions
    errors        the exception tree, its codes, and each code's HTTP and exit status
    spec          plain records of models and workers that cross processes
    request       GenerateRequest: one request, from the HTTP edge to the engine
    status        the daemon's status as typed records
    events        the daemon's events as typed records
    fields        records as JSON, field by field: the tolerant codec and the strict one
    reply         a worker's replies to the daemon (a result, its status) as typed records
    wire          JSON lines, bounded in size
    control       the control protocol
    render        human output for the CLI and the tray
    config/       reading and validating config.toml: its records, and a reader per table
    tomltable     a TOML table read from the user's own file, with typed getters
    chattemplate  chat templates a config gives, and the generic rendering of tools
    gguf          reading a GGUF file's header
    footprint     what a warm model takes of each device, predicted and measured
    hostcopy      the memfd host copies of model files
    offload       why models run on the CPU, and what would help on this machine
    paths         where arbiterd keeps its per-user files, and their safety checks
    procs         names of other processes, for humans

(`_packaging` links to packaging/, so the wheel carries the systemd and desktop files.)
"""

__version__ = "0.1.0"
