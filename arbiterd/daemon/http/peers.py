"""Who opened the other end of a connection the daemon accepted: owns SO_PEERCRED and the
kernel's socket table lookup (sock_diag netlink). Never guesses: a peer it cannot identify is
reported as unknown, and the caller treats it as a stranger.

- Unix socket: SO_PEERCRED, the credentials the kernel recorded when the peer called
  connect(2) (unix(7)).
- TCP over loopback: both ends are sockets of this host, so the peer's socket is in the kernel's
  table with the uid of the process that created it. It is found by its address pair (local =
  the client's address and port, remote = ours) with one SOCK_DIAG_BY_FAMILY request for that
  exact socket (sock_diag(7)): constant time, where a scan of /proc/net/tcp grows with every
  open connection. Only a socket that a process must still hold counts (ESTABLISHED or
  CLOSE_WAIT): the kernel reports uid 0 for TIME_WAIT and SYN_RECV entries, and kernels whose
  sock_i_uid() reads the socket's inode also for a socket its process has closed (an orphan:
  FIN_WAIT, CLOSING, LAST_ACK). A client that closes at once must not pass for root.
- TCP from any other address: another host (or a forwarder) whose user the kernel does not
  know here: unknown.

Lookups are synchronous but do not wait: the kernel answers a netlink request during the
sendto(2) that carries it, so the reply is read with MSG_DONTWAIT.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from dataclasses import dataclass

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 0x2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_TCP_STATES = 0xFFFFFFFF
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # inet_diag_sockid: sport, dport, src, dst (big-endian)
_SOCKID_TAIL = struct.Struct("=III")  # ... interface, cookie[2] (host order)
_REPLY = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: family, state, timer, retrans, id,
#                                          expires, rqueue, wqueue, uid, inode
_NLMSGERR = struct.Struct("=i")
_UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid
# include/net/tcp_states.h: TCP_ESTABLISHED, TCP_CLOSE_WAIT (states no orphan can be in).
_HELD_STATES = frozenset({1, 8})
_REPLY_BYTES = 4096


@dataclass(frozen=True)
class Peer:
    """The user at the other end of a connection: `uid`, or None with the reason it is unknown."""

    uid: int | None
    unknown_because: str = ""


def peer_of(sock: socket.socket) -> Peer:
    """The owner of the other end of the connected stream socket `sock`."""
    if sock.family == socket.AF_UNIX:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        except OSError as exc:
            return Peer(None, f"SO_PEERCRED failed: {exc.strerror}")
        return Peer(_UCRED.unpack(raw)[1])
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return Peer(None, f"address family {sock.family!r} carries no user")
    try:
        remote, local = sock.getpeername(), sock.getsockname()
    except OSError as exc:  # the peer has already gone
        return Peer(None, f"the connection is gone: {exc.strerror}")
    client, server = _address(remote[0]), _address(local[0])
    if not client.is_loopback:
        return Peer(None, f"{client} is not a loopback address: its user cannot be known here")
    return _tcp_owner(client, remote[1], server, local[1])


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as its socket's family sees it: an IPv4 client of a dual-stack listener
    appears as ::ffff:a.b.c.d, but its own socket is an AF_INET one."""
    address = ipaddress.ip_address(text.partition("%")[0])  # drop an IPv6 scope
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _tcp_owner(
    client: ipaddress.IPv4Address | ipaddress.IPv6Address,
    client_port: int,
    server: ipaddress.IPv4Address | ipaddress.IPv6Address,
    server_port: int,
) -> Peer:
    """The uid of the TCP socket whose local end is client:client_port and whose remote end is
    server:server_port, from one exact sock_diag lookup."""
    family = socket.AF_INET if client.version == 4 else socket.AF_INET6
    sockid = _SOCKID.pack(
        client_port, server_port, client.packed.ljust(16, b"\0"), server.packed.ljust(16, b"\0")
    )
    request = (
        _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_TCP_STATES)
        + sockid
        + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG
        ) as netlink:
            netlink.sendto(header + request, (0, 0))
            reply = netlink.recv(_REPLY_BYTES, socket.MSG_DONTWAIT)
    except OSError as exc:
        return Peer(None, f"the kernel's socket table could not be asked (sock_diag): {exc}")
    return _parse_reply(reply, sockid)


def _parse_reply(reply: bytes, sockid: bytes) -> Peer:
    if len(reply) < _NLMSGHDR.size:
        return Peer(None, "sock_diag sent a short reply")
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if kind == NLMSG_ERROR:
        code = -_NLMSGERR.unpack_from(reply, _NLMSGHDR.size)[0]
        if code == errno.ENOENT:
            return Peer(None, "the peer's socket is gone")
        return Peer(None, f"sock_diag refused the lookup: {errno.errorcode.get(code, code)}")
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _NLMSGHDR.size + _REPLY.size:
        return Peer(None, f"sock_diag sent an unexpected reply (type {kind})")
    _, state, _, _, found, _, _, _, uid, _ = _REPLY.unpack_from(reply, _NLMSGHDR.size)
    # The kernel falls back to a listening socket when no connection matches; its remote end
    # is empty, so comparing the whole address pair rules that out.
    if found[: _SOCKID.size] != sockid or state not in _HELD_STATES:
        return Peer(None, f"sock_diag found no connected socket of the peer (TCP state {state})")
    return Peer(uid)
