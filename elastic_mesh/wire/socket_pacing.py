"""Kernel pacing of a Gloo group's TCP connections, so a paced all-reduce leaves the host evenly.

The token bucket in pacing.py decides when each piece of a paced transfer is posted, but once a
piece is in the kernel TCP sends it at whatever rate the link takes, a window per round trip, and
after a loss or a stall it flushes what it holds: a link metered over one second sees 1.2-1.4x the
paced rate. Linux can pace every segment of a socket itself (SO_MAX_PACING_RATE: TCP's own pacing,
no fq qdisc needed since 4.13). Gloo does not expose its sockets, so this module finds them: the TCP
connections a group's construction opened in this process (NewConnections; Gloo connects every pair
of a group eagerly, one connection per peer), less those of servers this process already ran and of
the coordinator. That is a count, not a proof: if it finds anything but exactly one connection per
peer, the group is left to the token bucket alone rather than capping a socket that is not its own.

It never holds a socket open: each rate change duplicates the descriptor, checks it is still the
same socket (same inode), sets the option and closes the duplicate, so a group that Gloo closes
closes for real.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys

log = logging.getLogger(__name__)

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's value; Python names it from 3.12
UNLIMITED = 0xFFFFFFFF  # ~0U: no pacing cap
# The bucket sets the average and the kernel only smooths it: a cap a little over the bucket's rate
# lets the bucket lead, and lets the kernel drain what a loss held back without bursting.
HEADROOM = 1.1
_ESTABLISHED, _LISTEN = "01", "0A"


def _socket_inodes() -> dict[int, int]:
    """This process's open sockets: descriptor -> inode."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """Every TCP socket of this network namespace: inode -> (local port, remote port, state)."""
    table = {}
    for path in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


class NewConnections:
    """Tells which TCP connections this process opened since it was made (or since the last `since`).

    Make it before the Gloo device (whose listener would otherwise pass for a server this process
    already ran, hiding the connections it accepts), build a group, then call `since`."""

    def __init__(self) -> None:
        self._linux = sys.platform.startswith("linux")
        self._before = _socket_inodes() if self._linux else {}
        table = _tcp_table() if self._linux else {}
        # Servers this process already ran (snapshot servers): connections they accept are not a group's.
        self._serving = {table[i][0] for i in self._before.values() if i in table and table[i][2] == _LISTEN}

    def since(self, peers: int, avoid_ports: set[int] = frozenset()) -> GroupSockets | None:
        """The connections opened since, if they are exactly `peers` (one per peer of the group just
        built), else None: not Linux, or another thread opened one meanwhile. `avoid_ports`: remote
        ports that are never a group's (the coordinator's, whose requests may run in another thread)."""
        if not self._linux:
            return None
        after, table = _socket_inodes(), _tcp_table()
        new = {fd: inode for fd, inode in after.items() if fd not in self._before}
        found = [(fd, inode) for fd, inode in new.items()
                 if inode in table and table[inode][2] == _ESTABLISHED
                 and table[inode][0] not in self._serving and table[inode][1] not in avoid_ports]
        self._before = after
        if len(found) != peers:
            seen = ", ".join(f"port {table[i][0]} -> {table[i][1]} (state {table[i][2]})" if i in table
                             else f"descriptor {fd} (not TCP)" for fd, i in new.items())
            log.info("kernel pacing is off for this group (the token bucket alone paces it): %d new "
                     "connections where %d peers were expected; new sockets: %s", len(found), peers, seen or "none")
            return None
        return GroupSockets(found)


class GroupSockets:
    """The TCP connections of one process group, by descriptor and inode."""

    def __init__(self, connections: list[tuple[int, int]]) -> None:
        self.connections = connections

    def pace(self, bytes_per_s: float | None) -> int:
        """Caps every connection's sending rate (None: no cap); returns how many took it."""
        rate = UNLIMITED if bytes_per_s is None else max(1, min(UNLIMITED - 1, int(bytes_per_s * HEADROOM)))
        done = 0
        for fd, inode in self.connections:
            try:
                copy = os.dup(fd)
            except OSError:
                continue  # Gloo closed it
            try:
                if os.fstat(copy).st_ino != inode:
                    continue  # the descriptor now names another file
                with socket.socket(fileno=copy) as s:
                    copy = -1  # the socket object owns (and closes) the duplicate now
                    s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("I", rate))
                    done += 1
            except OSError as e:
                log.debug("could not set a pacing rate on descriptor %d: %s", fd, e)
            finally:
                if copy >= 0:
                    os.close(copy)
        return done
