"""Faults for a running LocalCluster, each injected at a chosen moment, and hostile input for any port.

Used by the chaos smoke in `make test` and by `launch/bench/chaos_soak.py`. Every fault is real: a
SIGKILL of a node's whole process tree, SIGSTOP/SIGCONT (a stalled or slowed node), the node's WAN
link taken down (a partition; needs a launch.wan.harness topology), the coordinator killed and restarted on
the same port and state, NaN pseudo-gradients (a command file the node's chaos hook takes), garbage
and oversized requests on every listening TCP port, forged join tokens.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from elastic_mesh.control.process_tree import descendants
from elastic_mesh.control.token import create_token, read_token


@dataclass
class Fault:
    kind: str
    target: str
    at: float  # time.monotonic() when it took effect
    detail: str = ""
    failed: str = ""  # what the cluster got wrong (a fault the harness injected but the cluster did not survive)


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state owned by any of pids (from /proc, in each process's own namespace)."""
    ports = set()
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
            for table in ("tcp", "tcp6"):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue  # the process exited meanwhile
    return ports


def hostile(host: str, port: int, seed: int) -> None:
    """Random bytes, a 99 GB Content-Length, 64 KiB of zeros and a malformed store write, one connection each."""
    rng = random.Random(seed)
    payloads = [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096))),
                b"GET / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
                b"\x00" * 65536, b"POST /v1/store/set HTTP/1.1\r\nContent-Length: 5\r\n\r\n{bad}"]
    for payload in payloads:
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.5)
                try:
                    s.recv(100)
                except (socket.timeout, OSError):
                    pass
        except OSError:
            pass


def hostile_all(targets: list[tuple[str, int]], seed: int) -> None:
    """hostile() against every (host, port) at once: a port that keeps the connection open costs its
    timeouts in parallel with the others, not after them."""
    threads = [threading.Thread(target=hostile, args=(host, port, seed)) for host, port in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class FaultInjector:
    def __init__(self, cluster, wan=None, seed: int = 0) -> None:
        self.cluster, self.wan = cluster, wan
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []

    # ---- nodes started through the injector can take commands (NaN, kill mid-all-reduce) -------------
    def control_dir(self, name: str) -> Path:
        return self.cluster.run_dir / name / "chaos"

    def start_node(self, name: str, extra: list[str] | None = None):
        self.control_dir(name).mkdir(parents=True, exist_ok=True)
        return self.cluster.start_node(name, ["--chaos.control_dir", str(self.control_dir(name)), *(extra or [])])

    def _record(self, kind: str, target: str, detail: str = "", at: float | None = None) -> Fault:
        fault = Fault(kind, target, time.monotonic() if at is None else at, detail)
        self.faults.append(fault)
        return fault

    def _tree(self, name: str) -> list[int]:
        pid = self.cluster.nodes[name].pid
        return [pid, *descendants(pid)]

    def _wait_log(self, name: str, text: str, since: int, timeout_s: float) -> bool:
        """Whether `text` appears in the node's log after offset `since` before it exits or timeout_s passes."""
        deadline = time.monotonic() + timeout_s
        while text not in self.cluster.log(name)[since:]:
            if time.monotonic() > deadline or self.cluster.nodes[name].poll() is not None:
                return False
            time.sleep(0.05)
        return True

    # ---- kills -------------------------------------------------------------------------------------
    def kill(self, name: str) -> Fault:
        """SIGKILL the whole node now (wherever it is: usually in its inner steps)."""
        self.cluster.kill_node(name)
        self.cluster.nodes[name].wait()
        return self._record("kill", name, "SIGKILL")

    def kill_in_allreduce(self, name: str, timeout_s: float = 120) -> Fault:
        """The node kills itself between the two phases of its next all-reduce."""
        (self.control_dir(name) / "kill-in-allreduce").write_text("")
        try:
            self.cluster.nodes[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} did not reach an all-reduce within {timeout_s:.0f} s") from None
        return self._record("kill-in-allreduce", name)

    def kill_while_joining(self, name: str, timeout_s: float = 120) -> Fault:
        """Starts a new node and SIGKILLs it once the coordinator admitted it, while it catches up."""
        seen = len(self.cluster.log(name))  # a reused name appends to the same log
        self.start_node(name)
        if not self._wait_log(name, "joined run", seen, timeout_s):
            self.cluster.kill_node(name)  # never leave it running as an extra member
            raise RuntimeError(f"{name} was not admitted within {timeout_s:.0f} s")
        self.cluster.kill_node(name)
        self.cluster.nodes[name].wait()
        return self._record("kill-while-joining", name)

    # ---- a source that lies or dies while a joiner downloads from it --------------------------------------
    def _command(self, name: str, command: str, text: str, timeout_s: float = 60) -> None:
        seen = len(self.cluster.log(name))
        (self.control_dir(name) / command).write_text(text)
        if not self._wait_log(name, f"command {command!r} taken", seen, timeout_s):
            raise RuntimeError(f"{name} did not take the command {command} within {timeout_s:.0f} s")

    def _finish_joiner(self, joiner: str, seen: int, timeout_s: float) -> tuple[bool, str]:
        """Whether the joiner caught up, and its log since `seen`; then SIGKILLs it (it only came to download)."""
        caught_up = self._wait_log(joiner, "caught up to outer step", seen, timeout_s)
        log_text = self.cluster.log(joiner)[seen:]
        self.cluster.kill_node(joiner)
        self.cluster.nodes[joiner].wait()
        return caught_up, log_text

    def corrupt_chunk(self, target: str, joiner: str, timeout_s: float = 180) -> Fault:
        """`target` serves its next snapshots with a bit flipped in every chunk; a new node joins and must
        take those chunks from the other sources (its log names the corrupt chunks), then is killed."""
        self._command(target, "corrupt-serving", "20")
        seen_target = len(self.cluster.log(target))
        if not self._wait_log(target, "with a bit flipped", seen_target, timeout_s):
            raise RuntimeError(f"{target} published no corrupted snapshot within {timeout_s:.0f} s")
        seen = len(self.cluster.log(joiner))
        self.start_node(joiner)
        fault = self._record("corrupt-chunk", target, f"joiner {joiner}")
        caught_up, log_text = self._finish_joiner(joiner, seen, timeout_s)
        if not caught_up:
            fault.failed = f"{joiner} did not catch up within {timeout_s:.0f} s past {target}'s corrupt chunks"
        elif "did not match their hash" not in log_text:
            fault.detail += "; the joiner asked the other sources only (no corrupt chunk reached it)"
        else:
            fault.detail += f"; {log_text.count('did not match their hash')} fetch(es) caught corrupt chunks"
        return fault

    def kill_while_serving(self, target: str, joiner: str, timeout_s: float = 180) -> Fault:
        """`target` serves slowly (0.4 s per chunk); a new node joins; the target is SIGKILLed while the
        joiner downloads from it. The joiner must finish from the other sources, then is killed."""
        self._command(target, "slow-serving", "0.4")
        seen = len(self.cluster.log(joiner))
        self.start_node(joiner)
        if not self._wait_log(joiner, "joined run", seen, timeout_s):
            self.cluster.kill_node(joiner)
            raise RuntimeError(f"{joiner} was not admitted within {timeout_s:.0f} s")
        time.sleep(0.3)  # its download is under way: the target's chunks take 0.4 s each
        self.cluster.kill_node(target)
        self.cluster.nodes[target].wait()
        fault = self._record("kill-while-serving", target, f"joiner {joiner}")
        caught_up, log_text = self._finish_joiner(joiner, seen, timeout_s)
        if not caught_up:
            fault.failed = f"{joiner} did not catch up within {timeout_s:.0f} s after its source {target} died"
        elif "request(s) failed" in log_text:
            fault.detail += "; the joiner's requests to the dead source failed over to the others"
        else:
            fault.detail += "; the joiner had nothing left to ask of the dead source"
        return fault

    # ---- slow and stalled nodes ----------------------------------------------------------------------
    def pause(self, name: str, seconds: float) -> Fault:
        """SIGSTOP every process of the node for `seconds` (a stall: GC, swap, preemption), in the background."""
        tree = self._tree(name)
        self._signal(tree, signal.SIGSTOP)
        fault = self._record("pause", name, f"{seconds:g} s")
        threading.Timer(seconds, self._signal, (tree, signal.SIGCONT)).start()
        return fault

    def throttle(self, name: str, seconds: float, duty: float = 0.5, period_s: float = 0.2) -> Fault:
        """Runs the node only `duty` of the time for `seconds` (in the background): a slow node."""
        fault = self._record("throttle", name, f"{duty:.0%} speed for {seconds:g} s")

        def run():
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tree = self._tree(name)
                self._signal(tree, signal.SIGSTOP)
                time.sleep(period_s * (1 - duty))
                self._signal(tree, signal.SIGCONT)
                time.sleep(period_s * duty)
        threading.Thread(target=run, daemon=True).start()
        return fault

    @staticmethod
    def _signal(pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # ---- the network -------------------------------------------------------------------------------
    def partition(self, name: str) -> Fault:
        """Drops every packet to and from the node (its WAN link goes down)."""
        if self.wan is None:
            raise RuntimeError("partitions need an emulated WAN (launch.wan.harness.WanTopology)")
        subprocess.run([*self.wan.exec_prefix(name), "ip", "link", "set", self.wan.interface(), "down"], check=True)
        return self._record("partition", name)

    def heal(self, name: str) -> None:
        subprocess.run([*self.wan.exec_prefix(name), "ip", "link", "set", self.wan.interface(), "up"], check=True)

    # ---- the coordinator -----------------------------------------------------------------------------
    def restart_coordinator(self, down_s: float = 2.0) -> Fault:
        self.cluster.kill_coordinator()
        fault = self._record("coordinator-restart", "coordinator", f"down {down_s:g} s")  # from the kill
        time.sleep(down_s)
        self.cluster.start_coordinator()
        return fault

    # ---- bad input -----------------------------------------------------------------------------------
    def poison(self, name: str) -> Fault:
        """The node's next pseudo-gradient is NaN."""
        (self.control_dir(name) / "nan").write_text("")
        return self._record("nan-pseudo-gradient", name)

    def hostile_input(self) -> Fault:
        """Hostile bytes on every TCP port any process of the cluster listens on."""
        started = time.monotonic()
        pids = {self.cluster.coordinator.pid}
        for proc in self.cluster.nodes.values():
            if proc.poll() is None:
                pids |= {proc.pid, *descendants(proc.pid)}
        ports = sorted(listening_ports(pids))
        seed = self.rng.randrange(1 << 30)
        if self.wan is None:
            hostile_all([("127.0.0.1", port) for port in ports], seed)
        else:  # from inside the coordinator's namespace, to each host's address
            targets = [(self.wan.address(h), p) for h in self.wan.hosts for p in ports]
            code = ("import sys, json; from launch.fault_injector import hostile_all; "
                    "hostile_all([tuple(t) for t in json.loads(sys.argv[1])], int(sys.argv[2]))")
            subprocess.run([*self.wan.exec_prefix("coordinator"), sys.executable, "-c", code, json.dumps(targets),
                            str(seed)], cwd=self.cluster.run_dir.parent, timeout=600)
        return self._record("hostile-input", "all ports", f"{len(ports)} ports", at=started)

    def forged_token(self) -> Fault:
        started = time.monotonic()
        host = self.wan.address("coordinator") if self.wan else "127.0.0.1"
        forged = create_token(os.urandom(32), f"{host}:{self.cluster.port}", "run-forged", 60)
        # Sent over the run's own transport (TLS where it speaks TLS), so the refusal is the token's.
        code = ("import sys\nfrom elastic_mesh.control.client import CoordinatorClient, CoordinatorError\n"
                "c = CoordinatorClient(sys.argv[1], 10, 10, tls_fp=sys.argv[3])\n"
                "try:\n    c.post('/v1/join', {'token': sys.argv[2]}, retry=False); print(200)\n"
                "except CoordinatorError as e:\n    print(e.status)\n")
        prefix = self.wan.exec_prefix("coordinator") if self.wan else []
        answer = subprocess.run([*prefix, sys.executable, "-c", code, f"{host}:{self.cluster.port}", forged,
                                 read_token(self.cluster.token).tls_fp],
                                capture_output=True, text=True, timeout=60).stdout.strip()
        if answer != "403":
            raise AssertionError(f"a forged token was answered {answer}, not 403")
        return self._record("forged-token", "coordinator", at=started)
