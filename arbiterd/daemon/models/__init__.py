"""The core: the configured models and the workers that serve them. Never an edge (this folder's
ruff.toml bans daemon/http and daemon/control); the supervisor composes it.

    slots         one model's lifecycle in the daemon (an Enum and a transition table)
    lifecycle     starts, restarts and stops each slot's worker
    workerclient  the daemon's side of a worker process, on the event loop
    workerport    what the daemon needs of a worker (a Protocol the test fakes implement too)
    routing       sends requests to workers, with one retry rule
    waiting       what a request that waits for the GPU is told meanwhile
    liveness      whether a worker that holds the token still shows signs of life
    holderwatch   asks the workers that hold a token for their status, applies liveness's verdict
    handoffs      turns the waits workers measured into handoffs and waits
    budgets       host RAM, prompt caches and each fitting set's device budget
    keepers       the groups' and the fitting sets' keepers, and the fitting sets' budgets
    unloads       unloads models idle for their unload_after_s, or over the host RAM budget
    modelstatus   one model's status record, from its slot, its worker and the VRAM watch
    modelfile     model files checked before anything loads
"""
