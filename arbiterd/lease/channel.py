"""The lease channel between a lender (`arbiterd rpc-server --lend`) and a borrower's daemon
(issue 46): what each side says, the proof that the borrower knows the key, and the timings
both keep. One JSON object per line (arbiterd/wire.py's framing) over one TCP connection that
the borrower opens and holds for as long as it borrows.

    lender -> borrower   challenge {nonce, lender, devices, timeout_s}  first, on connect
                         refused {reason}        and the lender closes
                         waiting {holder}        the lender's GPU is held there; granted later
                         grant {}                the borrower's models may use the devices
                         revoke {by}             the lender's `by` wants its GPU: release
                         beat {received_bytes, sent_bytes}   every BEAT_S
    borrower -> lender   hello {proof, borrower, models}     the answer to the challenge
                         want {}                 a model of the borrower waits for the devices
                         returned {}             every model released: nothing is held there
                         beat {}                 every BEAT_S

A side that hears nothing from the other for `timeout_s` (the lender's, told in the
challenge) takes it as gone: the lender ends the lease (closes the borrower's RPC connections,
gives its GPU back), the borrower gives up the lease until it can connect again.

The key never crosses the link: the borrower answers the challenge's random nonce with
HMAC-SHA256(key, nonce). That keeps the key from a listener; it does not make the link private,
and ggml's RPC connections that the lease admits carry no authentication at all
(docs/security.md, "Lending a GPU").
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import stat
from pathlib import Path

from arbiterd.errors import BadValueError
from arbiterd.paths import trusted_file_problem

BEAT_S = 1.0  # how often each side says it is there
DEFAULT_TIMEOUT_S = 10.0  # heard nothing this long: the other side is gone
HELLO_TIMEOUT_S = 5.0  # a borrower that does not answer the challenge this soon is refused
CONNECT_TIMEOUT_S = 5.0
KEY_MAX_BYTES = 4096
_PROOF_CONTEXT = b"arbiterd lease v1\0"  # a proof for this channel is no other protocol's


class Op(enum.StrEnum):
    CHALLENGE = "challenge"
    HELLO = "hello"
    REFUSED = "refused"
    WAITING = "waiting"
    GRANT = "grant"
    REVOKE = "revoke"
    WANT = "want"
    RETURNED = "returned"
    BEAT = "beat"


def proof(key: bytes, nonce: str) -> str:
    """The answer to a challenge's `nonce` with `key`."""
    return hmac.new(key, _PROOF_CONTEXT + nonce.encode(), hashlib.sha256).hexdigest()


def proves(key: bytes, nonce: str, answer: object) -> bool:
    """True when `answer` is the proof of `key` for `nonce` (compared in constant time)."""
    return isinstance(answer, str) and hmac.compare_digest(answer, proof(key, nonce))


def read_key(path: Path) -> bytes:
    """The key in the file at `path`: its content, surrounding blanks stripped. BadValueError
    for a file that is missing, empty, too long, or one that others could write or read (a key
    they can read is theirs too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadValueError(f"the lease key file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        problem = trusted_file_problem(f"the lease key file {path}", st)
        if problem is None and stat.S_IMODE(st.st_mode) & 0o077:
            problem = (
                f"the lease key file {path} has mode {stat.S_IMODE(st.st_mode):04o}, which lets "
                "group or others read it"
            )
        if problem is not None:
            raise BadValueError(f"{problem}; chmod 600 {path}")
        data = os.read(fd, KEY_MAX_BYTES + 1)
    finally:
        os.close(fd)
    key = data.strip()
    if not key:
        raise BadValueError(f"the lease key file {path} is empty")
    if len(data) > KEY_MAX_BYTES:
        raise BadValueError(f"the lease key file {path} is over {KEY_MAX_BYTES} bytes")
    return key


def split_address(text: str, what: str) -> tuple[str, int]:
    """HOST:PORT, the host a name or an IPv4 address (BadValueError naming `what`)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadValueError(f"{what} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50053")
    return host, int(port)
