"""`arbiterd rpc-server`: an engine process of its own, serving this machine's devices to other
engines through ggml's RPC server (issue 27). With the worker, the only code that loads
llama.cpp (this folder's ruff.toml allows it; the root's bans it everywhere else).

    server  the command: which devices, the loopback refusal, ggml's server in its thread
    front   `--clients N`: several clients at once, a server process each
"""
