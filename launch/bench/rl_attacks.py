"""The attack classes of launch/bench/rl_adversarial.py (its docstring lists them): each begins in
background threads against the running RL cluster and says, when asked, what it got."""

from __future__ import annotations

import base64
import socket
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from elastic_mesh import BroadcastMember, BroadcastSettings, CoordinatorClient, CoordinatorError
from elastic_mesh.control.token import read_token
from elastic_mesh.coordinator.run import revoke_token

if TYPE_CHECKING:
    from launch.bench.rl_adversarial import Bench


STRANGER = "127.0.0.2"  # where connections without a token come from (Linux answers all of 127/8)


class Evicted(Exception):
    """The orchestrator refused this attack's token for good (403)."""


class Attack(ABC):
    """One attack class: start() begins it in background threads, stop() ends it."""

    name = ""

    def __init__(self, bench: "Bench") -> None:
        self.bench, self.stopped = bench, threading.Event()
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self.members: list[BroadcastMember] = []
        self.tokens: list[str] = []

    def token(self, suffix: str = "") -> str:
        text = self.bench.cluster.token(f"rogue-{self.name}{suffix}").read_text()
        self.tokens.append(read_token(text).token_id)
        return text

    def member(self, suffix: str = "") -> BroadcastMember:
        """A broadcast member of a fresh worker token that serves nothing: the attacker's coordinator client."""
        member = BroadcastMember(self.token(suffix), "policy", self.bench.run_dir / f"rogue-{self.name}{suffix}",
                                 BroadcastSettings(host="127.0.0.1"), serve=False)
        self.members.append(member)
        return member

    def lease(self, client: CoordinatorClient) -> dict | None:
        """A lease of the newest version for this attack's `client`, or None (none now, or refused for a
        while); Evicted once its token is refused for good."""
        try:
            answer = client.post("/v1/rl/lease", {"held": self.bench.newest_version()}, retry=False)
        except CoordinatorError as e:
            if e.status == 403:
                raise Evicted(str(e)) from None
            self.stopped.wait(0.2)
            return None
        return answer if answer.get("status") == "ok" else None

    def spawn(self, target, *args) -> None:
        thread = threading.Thread(target=self._guard, args=(target, *args), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _guard(self, target, *args) -> None:
        while not self.stopped.is_set():
            try:
                target(*args)
                return
            except (OSError, CoordinatorError, ValueError):
                self.stopped.wait(0.2)

    @abstractmethod
    def start(self) -> None:
        """Begins the attack in threads of spawn()."""

    def detail(self) -> str:
        """What the attack got, beyond the run's pace (read before stop())."""
        return ""

    def stop(self) -> None:
        self.stopped.set()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass
        for t in self.threads:
            t.join(5)
        for member in self.members:
            member.stop()


class LeaseHog(Attack):
    name = "lease-hog"

    def start(self) -> None:
        client = self.bench.orchestrator_client(self.token())

        def hog() -> None:
            while not self.stopped.is_set():
                try:
                    client.post("/v1/rl/lease", {"held": 10 ** 6}, retry=False)
                except CoordinatorError as e:
                    if e.status == 403:  # evicted: this token is done
                        return
                    self.stopped.wait(0.2)
        for _ in range(4):
            self.spawn(hog)


class HugeBodies(Attack):
    name = "huge-bodies"

    def start(self) -> None:
        def send() -> None:
            while not self.stopped.is_set():
                with self.bench.raw_connection() as s:
                    s.sendall(b"POST /v1/rl/lease HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 62914560\r\n\r\n")
                    block = b"[" + b"1," * (1 << 19)
                    sent = 0
                    while sent < 60 << 20 and not self.stopped.is_set():
                        s.sendall(block)
                        sent += len(block)
        for _ in range(2):
            self.spawn(send)


class IdleFlood(Attack):
    name = "idle-flood"

    def start(self) -> None:
        host, port = self.bench.cluster.orchestrator_address.rsplit(":", 1)

        def hold() -> None:
            while not self.stopped.is_set():
                for s in list(self.sockets):
                    if s.fileno() == -1:
                        self.sockets.remove(s)
                while len(self.sockets) < 1058 and not self.stopped.is_set():
                    try:
                        self.sockets.append(socket.create_connection((host, int(port)), timeout=2,
                                                                     source_address=(STRANGER, 0)))
                    except OSError:
                        break
                self.stopped.wait(1.0)
        self.spawn(hold)


class ForgedTokens(Attack):
    name = "forged-tokens"

    def start(self) -> None:
        forged = self.bench.trainer_token[:-8] + "AAAAAAAA"

        def flood() -> None:
            client = self.bench.orchestrator_client(forged)
            while not self.stopped.is_set():
                try:
                    client.post("/v1/rl/lease", {"held": 0}, retry=False)
                except CoordinatorError:
                    pass
        for _ in range(4):
            self.spawn(flood)


class BogusHolder(Attack):
    name = "bogus-holder"

    def start(self) -> None:
        member = self.member()
        sink = socket.socket()
        sink.bind(("127.0.0.1", 0))
        sink.listen(1024)
        self.sockets.append(sink)

        def accept() -> None:
            while not self.stopped.is_set():
                conn, _ = sink.accept()
                self.sockets.append(conn)  # never answered

        def claim() -> None:
            claimed = -1
            while not self.stopped.is_set():
                newest = self.bench.newest_version()
                for version in range(max(claimed + 1, newest - 1), newest + 1):
                    try:
                        member.client.post("/v1/broadcast/have", {"kind": "policy", "version": version,
                                                                  "host": "127.0.0.1", "port": sink.getsockname()[1],
                                                                  "chunks": "all"}, retry=False)
                    except CoordinatorError:
                        pass
                claimed = newest
                self.stopped.wait(0.05)
        self.spawn(accept)
        self.spawn(claim)


class SlowReader(Attack):
    name = "slow-reader"

    def start(self) -> None:
        member = self.member()
        tls = member.client.tls_context()

        def read_slowly() -> None:
            while not self.stopped.is_set():
                version = self.bench.newest_version()
                origin = self.bench.origin_address(member, version)
                host, port = origin.rsplit(":", 1)
                raw = socket.create_connection((host, int(port)), timeout=10)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
                self.sockets.append(s)
                bitmap = base64.urlsafe_b64encode(b"\xff" * 64).decode().rstrip("=")
                s.sendall(f"GET /v1/policy/{version}/fresh/{bitmap}?stream=1 HTTP/1.1\r\nHost: x\r\n"
                          f"X-Mesh-Transfer-Key: {member.key}\r\n\r\n".encode())
                while not self.stopped.is_set() and s.recv(2048):
                    time.sleep(0.025)
                s.close()
        for _ in range(6):
            self.spawn(read_slowly)


class ReportTrainer(Attack):
    name = "report-trainer"

    def start(self) -> None:
        members = [self.member(str(i)) for i in range(2)]

        def report(member: BroadcastMember) -> None:
            while not self.stopped.is_set():
                newest = self.bench.newest_version()
                origin = self.bench.origin_address(member, newest)
                host, port = origin.rsplit(":", 1)
                for version in range(newest, newest + 300):
                    for path, body in (("/v1/broadcast/report", {"kind": "policy", "version": version,
                                                                 "source": origin, "chunk": 0, "reason": "bad\nline"}),
                                       ("/v1/broadcast/have", {"kind": "policy", "version": version, "host": host,
                                                               "port": int(port), "chunks": "all"})):
                        if self.stopped.is_set():
                            return
                        try:
                            member.client.post(path, body, retry=False)
                        except CoordinatorError:
                            pass
                self.stopped.wait(0.5)
        for m in members:
            self.spawn(report, m)


class SubmitFlood(Attack):
    name = "submit-flood"

    def start(self) -> None:
        client = self.bench.orchestrator_client(self.token())
        body = {"lease": "not-a-lease", "completions": []}

        def flood() -> None:
            while not self.stopped.is_set():
                try:
                    client.post("/v1/rl/submit", body, retry=False)
                except CoordinatorError:
                    pass
        for _ in range(4):
            self.spawn(flood)


class RevokedToken(Attack):
    """A worker token used once (so the orchestrator's token check holds it as valid), then revoked by the
    operator, leasing on: issue 50 measured 30 s more of service and a lease meanwhile."""

    name = "revoked-token"

    def start(self) -> None:
        text = self.token()
        client = self.bench.orchestrator_client(text)
        client.post("/v1/rl/status", {})
        revoke_token(self.bench.cluster.state_dir, read_token(text).token_id)
        self.revoked_at, self.late_leases, self.last_answer_s = time.monotonic(), 0, 0.0

        def lease() -> None:
            while not self.stopped.is_set():
                try:
                    answer = client.post("/v1/rl/lease", {"held": self.bench.newest_version()}, retry=False)
                    self.last_answer_s = time.monotonic() - self.revoked_at
                    if answer.get("status") == "ok" and self.last_answer_s > 2.0:
                        self.late_leases += 1
                except CoordinatorError:
                    self.stopped.wait(0.1)
        self.spawn(lease)

    def detail(self) -> str:
        return f"leases granted > 2 s after revocation: {self.late_leases}; last served {self.last_answer_s:.1f} s after"


class StaleGarbage(Attack):
    """Takes leases, lets them go stale (the run moves past their version), then sends well-formed garbage:
    issue 50 measured `stale` answers, no check and no penalty."""

    name = "stale-garbage"

    def start(self) -> None:
        client = self.bench.orchestrator_client(self.token())
        self.answers: list[str] = []

        def play() -> None:
            while not self.stopped.is_set():
                try:
                    lease = self.lease(client)
                except Evicted:
                    self.answers.append("evicted")
                    return
                if lease is None:
                    continue
                self.stopped.wait(3.0)  # several versions later: the lease is stale
                garbage = [{"tokens": [7] * 8, "logprobs": [-1.0] * 8, "finish_reason": "length",
                            "proof": base64.b64encode(bytes(64)).decode()} for _ in lease["requests"]]
                try:
                    answer = client.post("/v1/rl/submit", {"lease": lease["lease"], "completions": garbage},
                                         retry=False)
                    self.answers.append(str(answer.get("status")))
                except CoordinatorError as e:
                    self.answers.append("evicted" if e.status == 403 else f"HTTP {e.status}")
                    if e.status == 403:
                        return
        self.spawn(play)

    def detail(self) -> str:
        return f"answers to its garbage: {', '.join(self.answers) or 'none'}"


class Reroll(Attack):
    """Fishes for prompts it likes: takes a lease and gives it straight back, over and over (1 worker token)."""

    name = "reroll"

    def start(self) -> None:
        client = self.bench.orchestrator_client(self.token())
        self.leases, self.evicted = 0, False

        def fish() -> None:
            while not self.stopped.is_set():
                try:
                    lease = self.lease(client)
                except Evicted:
                    self.evicted = True
                    return
                if lease is not None:
                    self.leases += 1
                    client.post("/v1/rl/give-back", {"lease": lease["lease"], "reason": "not this one"},
                                retry=False)
        self.spawn(fish)

    def detail(self) -> str:
        return f"leases taken and given back: {self.leases}, then {'evicted' if self.evicted else 'not evicted'}"


class Leech(Attack):
    """4 broadcast members that fetch every policy version and serve nothing (4 worker tokens)."""

    name = "leech"

    def start(self) -> None:
        def leech(i: int) -> None:
            member = BroadcastMember(self.token(str(i)), "policy", self.bench.run_dir / f"rogue-leech{i}",
                                     BroadcastSettings(host="127.0.0.1"), serve=False)
            self.members.append(member)
            last = -1
            while not self.stopped.is_set():
                newest = self.bench.newest_version()
                if newest > last:
                    try:
                        member.fetch(newest)
                        last = newest
                    except Exception:  # noqa: BLE001 - a version retired mid-fetch: the next one
                        pass
                self.stopped.wait(0.1)
        for i in range(4):
            self.spawn(leech, i)


class SignedLiar(Attack):
    """A relay that fetches each version and serves it corrupted, under its own signature, to whoever asks
    (1 worker token): one honest report with that signature bans its token from serving the policy."""

    name = "signed-liar"

    def start(self) -> None:
        self.liar = BroadcastMember(self.token(), "policy", self.bench.run_dir / "rogue-liar",
                                    BroadcastSettings(host="127.0.0.1"))
        self.members.append(self.liar)
        self.liar.server.chunk_filter = lambda kind, version, index, data: bytes(b ^ 0x5A for b in data[:64]) + data[64:]

        # A relay like any other: each version fetched the moment it is announced, beside the honest members.
        self.spawn(self.liar.follow)

    def detail(self) -> str:
        served = sum(self.liar.server.served.values())
        try:
            self.liar.client.post("/v1/broadcast/have", {"kind": "policy", "version": self.bench.newest_version(),
                                                         "port": self.liar.server.port, "chunks": "all"}, retry=False)
            banned = "not banned"
        except CoordinatorError as e:
            banned = "its token banned from serving" if "banned from serving" in str(e) else f"have refused: {e}"[:90]
        return f"served {served / 1e6:.1f} MB of corrupt chunks, {banned}"


ATTACKS = [LeaseHog, HugeBodies, IdleFlood, ForgedTokens, BogusHolder, SlowReader, ReportTrainer, SubmitFlood,
           RevokedToken, StaleGarbage, Reroll, Leech, SignedLiar]
