"""LocalCluster: the launcher library. A coordinator and the processes of each role (DiLoCo nodes today;
the RL trainer, orchestrator and inference workers next) as real processes on this machine, optionally
each in its own emulated WAN host (used by launch/local.py, the tests and the benchmarks).

Every process is its own session (`spawn`), so killing it (SIGKILL to the process group) is what a
machine dying looks like. The coordinator can be killed and restarted on the same port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_mesh.control.process_tree import kill_tree
from elastic_mesh.coordinator.run import make_token

REPO = Path(__file__).resolve().parents[1]


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.2):
    """predicate()'s first truthy value, polled until timeout_s passes (then TimeoutError naming `what`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"timed out waiting for {what}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(PYTHONUNBUFFERED="1", PRIME_PLAIN_LOGS="1")
    return env


class LocalCluster:
    def __init__(self, run_dir: Path, config: str, overrides: list[str] | None = None, nproc_per_node: int = 1,
                 coordinator_args: list[str] | None = None, echo: bool = False, show_steps: bool = False,
                 wan=None) -> None:
        """wan: a launch.wan.harness.WanTopology that is up, with a host "coordinator" and one per node name;
        every process then runs in its host's namespace and talks over the emulated links."""
        self.run_dir, self.config, self.nproc, self.wan = Path(run_dir), config, nproc_per_node, wan
        self.overrides, self.coordinator_args = overrides or [], coordinator_args or []
        self.echo, self.show_steps = echo, show_steps
        self.coordinator: subprocess.Popen | None = None
        self.nodes: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.token = ""  # an observer token: the status and the dashboard
        self.tokens: dict[str, str] = {}  # node name -> its own node token (each contributor its own)

    @property
    def state_dir(self) -> Path:
        return self.run_dir / "coordinator"

    def _pump(self, proc: subprocess.Popen, prefix: str, log_path: Path) -> None:
        def run():
            with open(log_path, "a", encoding="utf-8") as log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if self.echo and (self.show_steps or " step " not in line or "outer step" in line
                                      or "eval_loss" in line):
                        sys.stdout.write(f"{prefix} {line}")
                        sys.stdout.flush()
        threading.Thread(target=run, daemon=True).start()

    def spawn(self, cmd: list[str], prefix: str, log_path: Path) -> subprocess.Popen:
        """One process of any role, in its own session, its output in `log_path` (and echoed with
        `prefix` when the cluster echoes). The caller puts the host's prefix (`_prefix`) in `cmd`."""
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=child_env(), start_new_session=True)
        self._pump(proc, prefix, log_path)
        return proc

    def start_coordinator(self, start_nodes: int = 1) -> None:
        """Starts it (again, on the same port and state, if it ran before)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        address_file = self.state_dir / "address"
        address_file.unlink(missing_ok=True)
        host = self.wan.address("coordinator") if self.wan else "127.0.0.1"
        cmd = [*self._prefix("coordinator"), sys.executable, "-m", "elastic_mesh.coordinator", "serve", "--host", host,
               "--port", str(self.port), "--state-dir", str(self.state_dir), "--start-nodes", str(start_nodes),
               *self.coordinator_args]
        self.coordinator = self.spawn(cmd, "[coordinator]", self.state_dir / "log")
        deadline = time.monotonic() + 60
        while not address_file.exists():
            if self.coordinator.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {self.state_dir / 'log'}")
            time.sleep(0.05)
        self.port = int(address_file.read_text().rsplit(":", 1)[1])
        if not self.token:
            self.token = make_token(self.state_dir, ttl_s=7 * 86400, role="observer")

    def node_token(self, name: str) -> str:
        """The node's own join token, made once per name (a restarted node presents it again)."""
        if name not in self.tokens:
            self.tokens[name] = make_token(self.state_dir, ttl_s=7 * 86400)
        return self.tokens[name]

    def kill_coordinator(self) -> None:
        kill_tree(self.coordinator.pid)
        self.coordinator.wait()

    def start_node(self, name: str, extra: list[str] | None = None, token: str | None = None,
                   cpus: str | None = None) -> subprocess.Popen:
        """cpus: pin the node to these cores (taskset list, e.g. "0" or "1-3"), so benchmarks can keep
        one emulated machine's work off another's cores."""
        node_dir = self.run_dir / name
        node_dir.mkdir(parents=True, exist_ok=True)
        wan_args = ["--mesh.interface", self.wan.interface()] if self.wan else []
        pin = ["taskset", "-c", cpus] if cpus else []
        cmd = [*self._prefix(name), *pin, str(Path(sys.executable).parent / "torchrun"), "--standalone",
               f"--nproc-per-node={self.nproc}", "-m", "prime.train", "--config", self.config,
               "--join", token or self.node_token(name), "--name", name, "--run-dir", str(node_dir), *wan_args,
               *self.overrides, *(extra or [])]
        self.nodes[name] = self.spawn(cmd, f"[{name}]", node_dir / "log")
        return self.nodes[name]

    def kill_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """SIGKILL: the agent and every local rank at once, like a machine dying. SIGTERM: the agent only,
        which forwards it to its ranks (a clean leave)."""
        if sig == signal.SIGKILL:
            kill_tree(self.nodes[name].pid)
        else:
            os.kill(self.nodes[name].pid, sig)

    def wait_nodes(self, timeout_s: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.nodes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {name: proc.poll() for name, proc in self.nodes.items()}

    def run_nodes(self, names: list[str], timeout_s: float, in_order: bool = False) -> None:
        """Starts the coordinator (waiting for all of `names`) and the nodes, and waits for every node to
        finish its run; a node that fails raises, with the exit codes and the first node's log.
        in_order: each node joins before the next starts, so their ranks follow `names`."""
        self.start_nodes(names, in_order)
        self.finish_nodes(names, timeout_s)

    def start_nodes(self, names: list[str], in_order: bool = False) -> None:
        """The first half of run_nodes: the coordinator and the nodes are started, not waited for."""
        self.start_coordinator(start_nodes=len(names))
        for k, name in enumerate(names, 1):
            self.start_node(name)
            if in_order:
                wait_for(lambda: len(self.status()["nodes"]) >= k, 120, f"{name} to join", every_s=1.0)

    def finish_nodes(self, names: list[str], timeout_s: float) -> None:
        """The second half of run_nodes: waits for every node to end, and raises if one failed."""
        codes = self.wait_nodes(timeout_s)
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"nodes did not finish: {codes}\n{self.log(names[0])[-2000:]}")

    def _prefix(self, host: str) -> list[str]:
        return self.wan.exec_prefix(host) if self.wan else []

    def status(self) -> dict:
        # The observer token names the coordinator's address (and its certificate, where it speaks TLS).
        fetch = ("import json, sys; from elastic_mesh.control.client import CoordinatorClient; "
                 "print(json.dumps(CoordinatorClient.for_token(sys.argv[1], 10, 10).get_status(sys.argv[1])))")
        # Run where the coordinator is reachable: in an emulated WAN, that is inside a namespace.
        result = subprocess.run([*self._prefix("coordinator"), sys.executable, "-c", fetch, self.token],
                                capture_output=True, text=True, timeout=30, check=True, cwd=REPO, env=child_env())
        return json.loads(result.stdout)

    def metrics(self, name: str) -> list[dict]:
        path = self.run_dir / name / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def outer_records(self, name: str) -> dict[int, dict]:
        return {r["outer_step"]: r for r in self.metrics(name) if "outer_step" in r}

    def log(self, name: str) -> str:
        path = self.run_dir / name / "log" if name != "coordinator" else self.state_dir / "log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        """Ends everything this cluster started, whatever state it is in."""
        for proc in list(self.nodes.values()) + ([self.coordinator] if self.coordinator else []):
            kill_tree(proc.pid)  # also the workers of a torchrun whose agent already exited
            proc.wait()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
