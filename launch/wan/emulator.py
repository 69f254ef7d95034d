"""User-space WAN link emulator over TUN devices, for kernels without sch_netem.

Runs in the root network namespace. For every emulated host it opens a TUN device *inside* that
host's namespace (setns), gives it the host's address, and then switches IP packets between the TUN
devices itself, imposing on each packet what the links would: the sender's upload (serialization at
its rate, a bounded FIFO queue with tail drop, one-way latency, jitter, loss), then, if the pair has
one, the path between the two (the same, one per direction: a congested route, a long detour), then
the receiver's download (the same). Jitter never reorders packets on a link (FIFO), as on a real path.

It works in ticks of a tenth of the shortest one-way latency (at most TICK_S): while packets are in
flight it starts at most one round per tick, in which it reads what the hosts sent meanwhile and hands
on what is due within half a tick, so packets keep their schedule to about ±half a tick (a packet sent
during a tick enters its link up to a tick late; ±2 ms under `global`, half its jitter).
A packet moving from one link to the next wakes nothing: that hop is taken in the next round that
wakes anyway, well before the next link's latency could make it due. A wake-up costs this Python
process far more than a packet does, and on CPUs shared with the emulated hosts each one preempts a
host: waking per packet and per hop (three times a packet) took ~4% of a core while a paced
all-reduce ran behind the hosts' compute, ticks 2.8%.

    python launch/wan/emulator.py CONFIG.json     (started by launch/wan/harness.py, prints "ready")
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 1500
TICK_S = 0.004  # the longest tick; see the module's docstring
READS_PER_TICK = 512  # per device: a TUN queue holds 500 packets
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns failed (needs root)")


def open_tun(namespace: str, ifname: str) -> int:
    """A TUN device created in `namespace`; the returned fd is usable from here."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)
    return fd


@dataclass
class Link:
    """One direction of a host's access link."""

    rate_bps: float
    latency_s: float
    jitter_s: float
    loss: float
    queue_s: float
    busy_until: float = 0.0
    last_delivery: float = 0.0
    dropped: int = 0
    carried: int = 0

    def schedule(self, now: float, size: int, rng: random.Random) -> float | None:
        """When a packet entering now leaves the far end, or None if it is lost or the queue is full."""
        start = max(now, self.busy_until)
        if start - now > self.queue_s or (self.loss and rng.random() < self.loss):
            self.dropped += 1
            return None
        self.busy_until = start + size * 8 / self.rate_bps
        jitter = rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        delivery = max(self.busy_until + max(0.0, self.latency_s + jitter), self.last_delivery)
        self.last_delivery = delivery
        self.carried += 1
        return delivery


def _link(profile: dict, mbit: float) -> Link:
    latency, jitter, loss = profile["latency_ms"] / 1e3, profile["jitter_ms"] / 1e3, profile["loss"]
    # Room for a few round trips of data at full rate, so TCP can fill the link; beyond that, tail drop.
    queue_s = max(0.05, 4 * latency + 0.02)
    return Link(mbit * 1e6, latency, jitter, loss, queue_s)


def _run_ahead_of_the_hosts() -> str:
    """A real link is hardware: it keeps its schedule however busy the hosts' CPUs are. This process
    shares the CPUs with the emulated nodes, and starved for a few hundred ms it would then deliver
    every overdue packet at once, a burst above the link's rate. So it takes a real-time priority
    (it sleeps in select() between packets, so it never holds a CPU for long); where that is not
    allowed, the highest niceness it may take."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        return "SCHED_RR"
    except (OSError, AttributeError):
        try:
            return f"nice {os.nice(-15)}"
        except OSError:
            return f"nice {os.nice(0)}"


def main() -> int:
    config = json.load(open(sys.argv[1]))
    priority = _run_ahead_of_the_hosts()
    rng = random.Random(config.get("seed", 0))
    hosts = config["hosts"]  # [{name, namespace, address, profile}]
    fds, up, down, by_address = {}, {}, {}, {}
    for host in hosts:
        fd = open_tun(host["namespace"], "wan0")
        fds[host["name"]] = fd
        up[host["name"]] = _link(host["profile"], host["profile"]["up_mbit"])
        down[host["name"]] = _link(host["profile"], host["profile"]["down_mbit"])
        by_address[bytes(int(x) for x in host["address"].split("."))] = host["name"]
        ns = ["ip", "netns", "exec", host["namespace"]]
        subprocess.run(ns + ["ip", "addr", "add", f"{host['address']}/{config['prefix_len']}", "dev", "wan0"], check=True)
        subprocess.run(ns + ["ip", "link", "set", "wan0", "mtu", str(MTU), "up"], check=True)
    paths = {}  # (from, to) -> Link: the route between two hosts, where it is slower than their access links
    for path in config.get("paths", []):
        for a, b in ((path["a"], path["b"]), (path["b"], path["a"])):
            paths[(a, b)] = _link(path["profile"], path["profile"]["mbit"])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    poller = select.epoll()
    source_of = {fd: name for name, fd in fds.items()}
    for fd in source_of:
        poller.register(fd, select.EPOLLIN)
    links = [*up.values(), *down.values(), *paths.values()]
    shortest = min(link.latency_s for link in links)
    tick = min(TICK_S, shortest / 10)
    half = tick / 2
    # A packet between two links (off its sender's uplink or off a route) only needs its next link's
    # schedule taken before that link's latency could make it due: up to `slack` after it got there.
    # So hops wait for a round that wakes anyway (a read or a delivery) rather than waking their own,
    # one wake-up a packet fewer. Hops are still taken in the order they came due (one heap), so each
    # link's FIFO holds; only deliveries, the writes to the hosts, keep to the tick.
    slack = max(0.0, min(link.latency_s - link.jitter_s for link in links) - tick)  # jitter may shorten a hop
    hops: list = []        # (due, seq, stage, source, destination, packet): stage 1 off the uplink, 2 off the route
    deliveries: list = []  # (due, seq, destination, packet)
    seq = 0
    print(f"ready ({priority}, tick {tick * 1e3:.2g} ms)", flush=True)
    woke = 0.0
    while not stop:
        if hops or deliveries:  # packets in flight: one round a tick at most, a new packet or the next due ends the wait
            rest = woke + tick - time.monotonic()
            if rest > 0:
                time.sleep(rest)
            due = min(deliveries[0][0] if deliveries else math.inf, hops[0][0] + slack if hops else math.inf)
            ready = poller.poll(min(0.5, max(0.0, due - half - time.monotonic())))
        else:  # idle: wake for the next packet a host sends
            ready = poller.poll(0.5)
        woke = now = time.monotonic()
        for fd, _ in ready:
            source = source_of[fd]
            for _ in range(READS_PER_TICK):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue  # IPv4 only (router solicitations and the like are dropped)
                destination = by_address.get(packet[16:20])
                if destination is None or destination == source:
                    continue
                arrival = up[source].schedule(now, len(packet), rng)
                if arrival is not None:
                    seq += 1
                    heapq.heappush(hops, (arrival, seq, 1, source, destination, packet))
        while hops and hops[0][0] <= now + half:
            due, _, stage, source, destination, packet = heapq.heappop(hops)
            if stage == 1 and (source, destination) in paths:  # off the sender's uplink, onto the route
                crossed = paths[(source, destination)].schedule(due, len(packet), rng)
                if crossed is not None:
                    seq += 1
                    heapq.heappush(hops, (crossed, seq, 2, source, destination, packet))
            else:  # now the receiver's downlink
                delivery = down[destination].schedule(due, len(packet), rng)
                if delivery is not None:
                    seq += 1
                    heapq.heappush(deliveries, (delivery, seq, destination, packet))
        while deliveries and deliveries[0][0] <= now + half:
            _, _, destination, packet = heapq.heappop(deliveries)
            try:
                os.write(fds[destination], packet)
            except (BlockingIOError, OSError):
                down[destination].dropped += 1
    stats = {name: {"up_dropped": up[name].dropped, "down_dropped": down[name].dropped,
                    "up_packets": up[name].carried, "down_packets": down[name].carried} for name in fds}
    stats.update({f"{a}->{b}": {"dropped": link.dropped, "packets": link.carried} for (a, b), link in paths.items()})
    print(json.dumps({"stats": stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
