"""Emulated WAN: one network namespace per host, each behind a link with latency, jitter, loss and rates.

    sudo python launch/wan/harness.py --profile global --hosts coordinator,node0,node1 -- CMD   (try it by hand)

From code (tests, benchmarks): `with WanTopology(["coordinator", "node0"], "global") as wan:` then run
processes with `wan.exec_prefix(name)` and reach them at `wan.address(name)`.

Backends: `netem` (kernel qdiscs on veth pairs through a bridge) where the kernel has sch_netem;
otherwise `tun`, a user-space emulator over TUN devices (launch/wan/emulator.py) that puts the same
delay, jitter, loss and rate limits on every packet. `backend` says which one ran; tests print it.
Each host's profile is its access link: a packet from A to B crosses A's upload then B's download,
so the RTT between A and B is 2 × (latency A + latency B). `paths` adds a route between two hosts
that is worse than their access links (tun backend only), so topologies need not be stars.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

REPO = Path(__file__).resolve().parents[2]


class LinkProfile(BaseModel):
    """One host's access link."""

    model_config = ConfigDict(extra="forbid")

    latency_ms: float = Field(ge=0, description="One-way latency of this host's access link.")
    jitter_ms: float = Field(0.0, ge=0, description="Uniform ± jitter per packet (no reordering).")
    loss: float = Field(0.0, ge=0, lt=1, description="Packet loss probability per direction.")
    up_mbit: float = Field(gt=0, description="Upload rate, Mbit/s.")
    down_mbit: float = Field(gt=0, description="Download rate, Mbit/s.")


class PathProfile(BaseModel):
    """The route between two hosts, each direction alike, where it is worse than their access links
    (a congested peering, a detour across an ocean). A packet crosses the sender's upload, then this,
    then the receiver's download."""

    model_config = ConfigDict(extra="forbid")

    latency_ms: float = Field(0.0, ge=0, description="Extra one-way latency on this route.")
    jitter_ms: float = Field(0.0, ge=0, description="Uniform ± jitter per packet (no reordering).")
    loss: float = Field(0.0, ge=0, lt=1, description="Packet loss probability per direction.")
    mbit: float = Field(gt=0, description="Rate of the route, Mbit/s, each direction.")


# Latencies: half the typical RTT between regions is split over the two access links (so two `us`
# hosts see ~40 ms RTT, two `global` hosts ~160 ms: US↔Asia). Rates are scaled down so the CPU
# models here see INTELLECT-1's communication-to-compute ratio (a blocking all-reduce ≈ 20% of a
# round): cpu-demo's 6.6 MB int8 exchange per outer step at 5 Mbit/s ≈ 10 s against ~40 s of compute.
PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile(latency_ms=0.25, up_mbit=100, down_mbit=100),
    "us": LinkProfile(latency_ms=10, jitter_ms=1, up_mbit=20, down_mbit=20),
    "transatlantic": LinkProfile(latency_ms=20, jitter_ms=2, loss=0.0001, up_mbit=10, down_mbit=10),
    "global": LinkProfile(latency_ms=40, jitter_ms=4, loss=0.001, up_mbit=5, down_mbit=5),
}


def kernel_has_netem() -> bool:
    """Tries a netem qdisc in a throw-away namespace."""
    if shutil.which("tc") is None or os.geteuid() != 0:
        return False
    probe = f"pwprobe{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
        result = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                 "delay", "1ms"], capture_output=True)
        return result.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def can_emulate() -> str | None:
    """None if this machine can build a topology, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is missing"
    if not kernel_has_netem() and not Path("/dev/net/tun").exists():
        return "neither sch_netem nor /dev/net/tun is available"
    return None


class WanTopology:
    def __init__(self, hosts: list[str], profile: str | LinkProfile = "lan",
                 overrides: dict[str, LinkProfile] | None = None, backend: str = "auto",
                 paths: dict[tuple[str, str], PathProfile] | None = None) -> None:
        why = can_emulate()
        if why:
            raise RuntimeError(f"cannot emulate a WAN here: {why}")
        base = PROFILES[profile] if isinstance(profile, str) else profile
        self.profiles = {h: (overrides or {}).get(h, base) for h in hosts}
        self.paths = dict(paths or {})
        unknown = sorted({h for pair in self.paths for h in pair} - set(hosts))
        if unknown:
            raise ValueError(f"paths name hosts that are not in the topology: {unknown}")
        self.hosts = hosts
        self.tag = f"pw{os.getpid() % 100000}"
        self.backend = ("netem" if kernel_has_netem() and not self.paths else "tun") if backend == "auto" else backend
        if self.backend == "netem" and self.paths:
            # netem shapes a device, and a host's access link is one device; a route per peer would need
            # per-destination classes we have no kernel here to test. The tun emulator does routes.
            raise ValueError("per-pair paths need the tun backend (backend='tun' or 'auto')")
        self._emulator: subprocess.Popen | None = None
        self.emulator_priority = ""  # tun backend: the scheduling the emulator got (SCHED_RR, or a niceness)
        self._workdir = Path(tempfile.mkdtemp(prefix="prime-wan-"))
        self._up = False

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{self.hosts.index(host)}"

    def address(self, host: str) -> str:
        return f"10.77.{self.hosts.index(host) // 250}.{self.hosts.index(host) % 250 + 2}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host)]

    @property
    def emulator_pid(self) -> int | None:
        """The user-space emulator's process (tun backend), for a benchmark that counts its CPU time."""
        return self._emulator.pid if self._emulator is not None and self._emulator.poll() is None else None

    def interface(self) -> str:
        return "wan0"

    def describe(self) -> str:
        links = ", ".join(f"{h}: {p.latency_ms:g} ms ±{p.jitter_ms:g}, {p.loss * 100:g}% loss, "
                          f"{p.up_mbit:g}/{p.down_mbit:g} Mbit/s" for h, p in self.profiles.items())
        routes = "".join(f"; route {a}<->{b}: +{p.latency_ms:g} ms, {p.loss * 100:g}% loss, {p.mbit:g} Mbit/s"
                         for (a, b), p in self.paths.items())
        priority = f" ({self.emulator_priority})" if self.emulator_priority else ""
        return f"WAN backend {self.backend}{priority}; {links}{routes}"

    def up(self) -> "WanTopology":
        atexit.register(self.down)
        for host in self.hosts:
            ns = self.namespace(host)
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"], check=True)
        self._up = True
        if self.backend == "tun":
            self._start_tun()
        else:
            self._start_netem()
        return self

    def _start_tun(self) -> None:
        config = {"prefix_len": 16, "hosts": [{"name": h, "namespace": self.namespace(h), "address": self.address(h),
                                               "profile": self.profiles[h].model_dump()} for h in self.hosts],
                  "paths": [{"a": a, "b": b, "profile": p.model_dump()} for (a, b), p in self.paths.items()]}
        path = self._workdir / "emulator.json"
        path.write_text(json.dumps(config))
        self._emulator = subprocess.Popen([sys.executable, "-m", "launch.wan.emulator", str(path)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self._emulator.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"the WAN emulator did not start: {line}{self._emulator.stderr.read()[-2000:]}")
        self.emulator_priority = line.strip().removeprefix("ready").strip(" ()")

    def _start_netem(self) -> None:
        # A bridge in a hub namespace; each host's veth carries netem: egress at the host is its upload,
        # egress at the hub end is its download. (Not exercised on machines without sch_netem.)
        hub = f"{self.tag}-hub"
        subprocess.run(["ip", "netns", "add", hub], check=True)
        run = lambda *args, ns=hub: subprocess.run(["ip", "netns", "exec", ns, *args], check=True)  # noqa: E731
        run("ip", "link", "add", "br0", "type", "bridge")
        run("ip", "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            p, ns = self.profiles[host], self.namespace(host)
            subprocess.run(["ip", "link", "add", f"h{i}", "netns", hub, "type", "veth", "peer", "name", "wan0",
                            "netns", ns], check=True)
            run("ip", "link", "set", f"h{i}", "master", "br0", "up")
            run("ip", "addr", "add", f"{self.address(host)}/16", "dev", "wan0", ns=ns)
            run("ip", "link", "set", "wan0", "up", ns=ns)
            for dev, rate, where in (("wan0", p.up_mbit, ns), (f"h{i}", p.down_mbit, hub)):
                run("tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", f"{p.latency_ms}ms",
                    f"{p.jitter_ms}ms", "loss", f"{p.loss * 100}%", "rate", f"{rate}mbit", ns=where)

    def down(self) -> None:
        if self._emulator and self._emulator.poll() is None:
            self._emulator.terminate()
            try:
                self._emulator.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._emulator.kill()
        if self._up:
            for ns in [self.namespace(h) for h in self.hosts] + [f"{self.tag}-hub"]:
                # Processes left in a namespace would keep it alive; end them first.
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), 9)
                    except (ProcessLookupError, ValueError):
                        pass
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._up = False
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "WanTopology":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def interface_bytes(net_dev: str, interface: str = "wan0", received: bool = True) -> int:
    """Bytes an interface has received (or transmitted), from the text of a namespace's /proc/net/dev.
    Received bytes are what the link delivered, after its rate limit; with the tun backend, transmitted
    bytes are what TCP handed the emulator, bursts above the link rate included."""
    for line in net_dev.splitlines():
        if line.strip().startswith(f"{interface}:"):
            return int(line.split(":", 1)[1].split()[0 if received else 8])
    raise RuntimeError(f"no {interface} interface in this namespace")


class WireMeter:
    """Samples the bytes each host's link delivered to it (every `every_s`, stamped with time.time() like
    the nodes' metrics) while a run goes on, in a thread, so a benchmark can report the peak rate on the
    wire over any `window_s` (a burst at the link's rate shows; the same bytes spread out do not)."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.25) -> None:
        self.samples: dict[str, list[tuple[float, int]]] = {name: [] for name in pids}
        self._pids, self._every_s, self._stop = pids, every_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="wire-meter")

    def _run(self) -> None:
        # /proc/<pid>/net/dev of a process in the host's namespace: no process spawned per reading.
        while not self._stop.is_set():
            now = time.time()
            for name, pid in self._pids.items():
                try:
                    self.samples[name].append((now, interface_bytes(Path(f"/proc/{pid}/net/dev").read_text())))
                except (OSError, RuntimeError, ValueError):
                    pass  # the process is gone: the run is over for that host
            self._stop.wait(self._every_s)

    def __enter__(self) -> "WireMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_bytes_per_s(self, window_s: float = 1.0, start: float = 0.0, end: float = float("inf")) -> float:
        """The highest rate any host received at over any `window_s` between times start and end."""
        peak = 0.0
        for every in self.samples.values():
            samples = [s for s in every if start <= s[0] <= end]
            j = 0
            for i, (t, sent) in enumerate(samples):
                j = max(j, i + 1)
                while j < len(samples) and samples[j][0] - t < window_s:
                    j += 1
                if j == len(samples):
                    break
                peak = max(peak, (samples[j][1] - sent) / (samples[j][0] - t))
        return peak

    def mean_bytes_per_s(self, start: float = 0.0, end: float = float("inf")) -> float:
        """Each host's bytes received between times start and end, per second, averaged over hosts."""
        spans = [[x for x in s if start <= x[0] <= end] for s in self.samples.values()]
        rates = [(s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]) for s in spans if len(s) > 1]
        return sum(rates) / len(rates) if rates else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description="Build an emulated WAN and run a command in one of its hosts.",
                                     epilog="example: python launch/wan/harness.py --profile global --hosts a,b "
                                            "--in b -- ping -c 3 10.77.0.2")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="global")
    parser.add_argument("--hosts", default="a,b", help="comma-separated host names")
    parser.add_argument("--in", dest="host", default=None, help="host to run the command in (default: the first)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = parser.parse_args()
    hosts = args.hosts.split(",")
    with WanTopology(hosts, args.profile) as wan:
        print(wan.describe())
        for h in hosts:
            print(f"  {h}: {wan.address(h)} (namespace {wan.namespace(h)})")
        command = [c for c in args.command if c != "--"]
        if command:
            return subprocess.run(wan.exec_prefix(args.host or hosts[0]) + command).returncode
        print("no command given; topology torn down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
