"""An RL run on one machine, every role its own process: coordinator, orchestrator, trainer, workers.
Used by `make rl-demo` (launch/rl_demo.py), the RL end-to-end tests and launch/bench/rl_async.py.

Each role gets its own token, made the way an operator would (`token create`): the trainer a worker
token with the publish right, the orchestrator a worker token naming the service `orchestrator` (its TLS
certificate names it), every worker a worker token of its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_mesh.control.process_tree import kill_tree
from elastic_mesh.coordinator.run import make_token
from prime.rl.token_flags import DTYPE_ATTRIBUTE, ORCHESTRATOR_SERVICE
from launch.cluster import REPO, child_env, wait_for

WEEK_S = 7 * 86400


def new_policy(out: Path, seed: int = 0, calibrate_args: list[str] | None = None) -> Path:
    """A fresh digit policy with TOPLOC thresholds measured on it (`python -m prime.verify.calibrate`)."""
    from prime.rl.policy import new_digit_policy

    new_digit_policy(out, seed=seed)
    return calibrate(out, calibrate_args)


def calibrate(policy: Path, args: list[str] | None = None) -> Path:
    """Measures TOPLOC thresholds on a local HF policy directory (writes its toploc.json), as the demo does."""
    args = args if args is not None else [
        "--threads", "1", "--batch-sizes", "1,8,32", "--rollouts", "64", "--max-tokens", "16", "--margin", "16"]
    done = subprocess.run([sys.executable, "-m", "prime.verify.calibrate", "--model", str(policy), *args], cwd=REPO,
                          env=child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"calibrating {policy} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return policy


class RLCluster:
    def __init__(self, run_dir: Path, policy: Path, orchestrator_sets: list[str] | None = None,
                 trainer_sets: list[str] | None = None, wan=None, trainer_ranks: int = 1,
                 placement: dict[str, str] | None = None, worker_args: list[str] | None = None,
                 niceness: dict[str, int] | None = None, tls: bool = False) -> None:
        """wan: a launch.wan.harness.WanTopology whose hosts are named after the roles (coordinator,
        orchestrator, trainer, worker names): each process runs in its host's namespace. placement: role ->
        the WAN host it runs on where that is not the host of its own name (roles sharing a host share its
        access link). trainer_ranks: local ranks of the trainer (more than 1: torchrun, FSDP2). worker_args:
        command-line options of every worker. niceness: role -> its CPU niceness (nice(1), 0 to 19): on one
        machine every role shares its cores, where a deployment gives each role a machine of its own.
        tls: the coordinator serves TLS (--tls on) even on loopback, and with it every role of the run."""
        for role, value in (niceness or {}).items():
            if not 0 <= value <= 19:
                raise ValueError(f"niceness of {role} must be between 0 and 19, not {value}")
        self.run_dir, self.policy, self.wan, self.trainer_ranks = Path(run_dir), Path(policy), wan, trainer_ranks
        self.placement = dict(placement or {})
        self.orchestrator_sets, self.trainer_sets = orchestrator_sets or [], trainer_sets or []
        self.worker_args = list(worker_args or [])
        self.niceness = dict(niceness or {})
        self.tls = tls
        self.procs: dict[str, subprocess.Popen] = {}
        self.tokens: dict[str, str] = {}
        self.orchestrator_address = ""
        self.run_dir.mkdir(parents=True, exist_ok=True)

    @property
    def state_dir(self) -> Path:
        return self.run_dir / "coordinator"

    def host(self, name: str) -> str:
        return self.wan.address(self.placement.get(name, name)) if self.wan else "127.0.0.1"

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.run_dir / f"{name}.log", "a", encoding="utf-8")
        prefix = self.wan.exec_prefix(self.placement.get(name, name)) if self.wan else []
        if self.niceness.get(name):
            prefix += ["nice", "-n", str(self.niceness[name])]
        proc = subprocess.Popen(prefix + cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def token(self, name: str, publish: bool = False, role: str = "worker", service: str = "",
              attributes: dict[str, str] | None = None) -> Path:
        """The token file of a role (made once per name, so a restarted process presents the same token)."""
        path = self.run_dir / f"{name}.token"
        if name not in self.tokens:
            self.tokens[name] = make_token(self.state_dir, WEEK_S, role=role, publish=publish, service=service,
                                           attributes=attributes)
            path.write_text(self.tokens[name])
        return path

    def start(self, workers: list[str]) -> None:
        self.start_coordinator()
        self.start_orchestrator()
        self.start_trainer()
        for name in workers:
            self.start_worker(name)

    def start_coordinator(self) -> None:
        address = self.state_dir / "address"
        address.unlink(missing_ok=True)
        self.spawn("coordinator", [sys.executable, "-m", "elastic_mesh.coordinator", "serve", "--host",
                                   self.host("coordinator"),
                                   "--port", "0", "--state-dir", str(self.state_dir),
                                   *(["--tls", "on"] if self.tls else [])])
        wait_for(lambda: address.exists() or self._died("coordinator"), 60, "the coordinator's address")

    def start_orchestrator(self) -> None:
        """Starts it; again, on the same port and run directory, if it ran before (it continues the run)."""
        address = self.run_dir / "orchestrator" / "address"
        address.unlink(missing_ok=True)
        port = self.orchestrator_address.rsplit(":", 1)[1] if self.orchestrator_address else "0"
        self.spawn("orchestrator", [sys.executable, "-m", "prime.rl.orchestrator", "--token-file",
                                    str(self.token("orchestrator", service=ORCHESTRATOR_SERVICE)), "--run-dir", str(self.run_dir / "orchestrator"),
                                    "--host", self.host("orchestrator"), "--advertise-host", self.host("orchestrator"),
                                    "--port", port,
                                    *_overrides(self.orchestrator_sets)])
        wait_for(lambda: address.exists() or self._died("orchestrator"), 120, "the orchestrator's address")
        self.orchestrator_address = address.read_text().strip()

    def start_trainer(self) -> None:
        launcher = ([str(Path(sys.executable).parent / "torchrun"), "--standalone",
                     f"--nproc-per-node={self.trainer_ranks}"] if self.trainer_ranks > 1 else [sys.executable])
        self.spawn("trainer", [*launcher, "-m", "prime.rl.trainer", "--token-file",
                               str(self.token("trainer", publish=True)), "--policy", str(self.policy),
                               "--orchestrator", self.orchestrator_address, "--run-dir", str(self.run_dir / "trainer"),
                               "--advertise-host", self.host("trainer"),
                               *_overrides(self.trainer_sets)])

    def start_worker(self, name: str, module: str = "prime.rl.worker", extra: list[str] | None = None) -> None:
        args = [*self.worker_args, *(extra or [])]
        # The worker's token admits it in the dtype it computes in (prime/rl/token_flags.py).
        dtype = args[args.index("--dtype") + 1] if "--dtype" in args[:-1] else "float32"
        token = self.token(name, attributes={DTYPE_ATTRIBUTE: dtype} if dtype != "float32" else None)
        self.spawn(name, [sys.executable, "-m", module, "--token-file", str(token),
                          "--work-dir", str(self.run_dir / name), "--advertise-host", self.host(name),
                          *args])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            kill_tree(proc.pid, sig)
        proc.wait()

    def _died(self, name: str) -> bool:
        code = self.procs[name].poll()
        if code is not None:
            raise RuntimeError(f"{name} exited with {code}; see {self.run_dir / (name + '.log')}")
        return False

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} still running after {timeout_s:.0f} s; see {self.run_dir / (name + '.log')}") from None

    def events(self, kind: str | None = None) -> list[dict]:
        path = self.run_dir / "orchestrator" / "metrics.jsonl"
        if not path.exists():
            return []
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e for e in events if kind is None or e.get("event") == kind]

    def trainer_records(self) -> list[dict]:
        path = self.run_dir / "trainer" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def summary(self) -> dict | None:
        path = self.run_dir / "orchestrator" / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            if self.procs[name].poll() is None:
                kill_tree(self.procs[name].pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()

    def __enter__(self) -> "RLCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _overrides(sets: list[str]) -> list[str]:
    """Config fields given as "KEY=VALUE" (orchestrator_sets, trainer_sets) as the roles' options --KEY VALUE."""
    out = []
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r}: write KEY=VALUE, e.g. async_level=2")
        out += [f"--{key}", value]
    return out
