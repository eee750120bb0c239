"""The HTTP edge: the OpenAI and Ollama APIs (and OpenAI's Responses, llama-server's /infill)
on the daemon's TCP port and API socket. Reaches the core only through daemon/service.py
(this folder's ruff.toml bans the rest of the daemon).

    server           the listeners: sockets, who connects (peers), browsers' pages
    app              the routes, who may call them, what needs the config checked once
    streams          server-sent events and NDJSON lines, closed when the client goes
    envelopes        the one mapping from arbiterd's errors to OpenAI's envelope and status
    jsonbody         a body parsed and bounded once
    openai_requests  OpenAI's bodies as the one record the daemon serves (GenerateRequest)
    ollama           Ollama's bodies and answers, translated
    responses        OpenAI's Responses API, run as a chat request
    infill           llama-server's /infill, run as a completion
    images           image parts checked (and WebP converted) before a worker sees them
    peers            SO_PEERCRED: who opened a connection
    browsers         what a web page in the owner's browser may send
"""
