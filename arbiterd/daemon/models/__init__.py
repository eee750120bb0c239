"""The core: the configured models and the workers that serve them. Never an edge (this folder's
ruff.toml bans daemon/http and daemon/control); the supervisor composes it.

    slots         one model's lifecycle in the daemon (an Enum and a transition table)
    lifecycle     starts, restarts and stops each slot's worker
    workerclient  the daemon's side of a worker process, on the event loop
    routing       sends requests to workers, with one retry rule
    waiting       what a request that waits for the GPU is told meanwhile
    liveness      whether a worker that holds the token still shows signs of life
    handoffs      turns the waits workers measured into handoffs and waits
    budgets       host RAM, prompt caches and each fitting set's device budget
    modelfile     model files checked before anything loads
"""
