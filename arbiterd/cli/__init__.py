"""The `arbiterd` command: what runs in the user's shell, never llama.cpp.

    main           the command line: parsing, the shared subcommands, exit statuses
    commands       the subcommands that talk to a running daemon (status, warm, events, ...)
    controlclient  the control socket's client side (blocking)
    runner         `arbiterd run CMD`: CMD holds the GPU token while it runs
    install        `arbiterd install` / `uninstall`: the user unit and desktop entries
    discovery      the GGUFs other tools keep (Ollama's store too), for `models` and install
    served         what arbiterd serves, as `models` lists it: the running daemon's, else the
                   config's
    starter        the commented config install writes from them
    demo           `arbiterd demo`: a real daemon, two models, live handoffs

May start the daemon (`arbiterd daemon` runs arbiterd.daemon.serve), the tray and an RPC server
(`arbiterd rpc-server` runs arbiterd.rpcserver, an engine process of its own); never imports the
worker or llama.cpp (ruff's banned-api rule in this folder's ruff.toml says so).
"""
