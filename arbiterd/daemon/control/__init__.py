"""The control edge: the control socket (arbiterd/control.py's protocol) that the CLI and the
tray speak. Reaches the core only through daemon/service.py (this folder's ruff.toml bans the
rest of the daemon).

    server      the socket's server side: one task per connection, events pushed, outboxes
    devicelist  the answer to `devices`: local devices from the workers' hello, RPC servers probed
"""
