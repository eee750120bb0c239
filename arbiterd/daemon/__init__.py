"""What runs in the daemon process: never llama.cpp, which only engine processes load.

The daemon in rooms by role (docs/architecture.md draws them):

    http/        the edge for HTTP clients: OpenAI, Ollama, Responses and /infill routes, bodies,
                 who may connect, images
    control/     the edge for the control socket: the CLI's and the tray's requests
    models/      the core: one slot per model, its worker, routing, waits, handoffs, budgets
    observe/     what the daemon tells: the event bus, the journal, metrics, VRAM telemetry
    stepaside/   the daemon's own hold of the GPU: game mode, programs it steps aside for

and the composition root beside them:

    serve        `arbiterd daemon`: wires the rooms, binds the sockets, runs until stopped
    service      what an edge may ask of the core (a Protocol): the one door between them
    supervisor   the Service: composes the rooms, status and commands
    reload       a re-read config applied to the running daemon (`arbiterd reload`)
    configwatch  a saved config applied as `arbiterd reload`
    instance     one daemon per control socket
    socketfile   the socket files: made private, a stale one replaced only by its owner

An edge reaches the core only through `service.Service`; each room's ruff.toml bans what it
must not import, and this folder's bans the worker, the CLI, the tray and llama.cpp.
"""
