"""A stand-in for a front's server process (arbiterd/rpcserver/front.py) in the lease tests:
`python -m tests.support.echo_server ... --listen HOST:PORT ...` listens where it is told and
echoes every byte of each connection, one connection at a time, as ggml's server serves one
client; every other argument (the devices, --clients) is the front's and is ignored. Ends on
SIGTERM, as the real one does."""

from __future__ import annotations

import socket
import sys


def main(argv: list[str]) -> int:
    host, _, port = argv[argv.index("--listen") + 1].rpartition(":")
    with socket.create_server((host, int(port))) as listener:
        while True:
            conn, _ = listener.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
