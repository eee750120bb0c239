"""What runs in the daemon process: never llama.cpp, which only workers load.

    serve        `arbiterd daemon`: wires the parts, binds the sockets, runs until stopped
    supervisor   the Service the edges call: composes the parts below, status and commands
    slots        one model's lifecycle in the daemon (an Enum and a transition table)
    lifecycle    starts, restarts and stops each slot's worker
    workerclient the daemon's side of a worker process, on the event loop
    routing      sends requests to workers, with one retry rule
    eventbus     stamps, counts, journals and fans out every event
    handoffs     turns the waits workers measured into handoffs and waits
    vramwatch    VRAM readings, the engines' own figures, verified teardowns
    service      what the edges may ask of the core (a Protocol)
    httpapi      the OpenAI HTTP API;  httpserver  its listener, peers  who connects
    controlserver  the control socket's server side
    journal      the SQLite event history;  metrics  Prometheus figures
    instance     one daemon per control socket;  socketfile  the socket files
    modelfile    model files checked before anything loads
    telemetry/   VRAM readers (NVML, AMD sysfs, DRM fdinfo, accounting) and the sampler

Imports the shared modules (arbiterd/*.py), never the worker, the CLI or the tray (ruff's
banned-api rule in this folder's ruff.toml says so).
"""
