"""TLS on the coordinator and on members' chunk servers, over real sockets on loopback.

What an operator gets with no set-up: the coordinator makes its own certificate, tokens pin it, a
node's servers get certificates the coordinator signs at join. What an attacker on the path gets:
nothing readable (a recording proxy sees no token, session or transfer key), and no way to stand in
for the coordinator or a member (a foreign certificate is refused before a byte is sent).
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from cryptography import x509

from elastic_mesh.broadcast.member import BroadcastMember, BroadcastSettings
from elastic_mesh.control.client import CoordinatorClient, CoordinatorError
from elastic_mesh.control.lifeline import LifeLine
from elastic_mesh.control.tls import (
    MemberIdentity,
    RunAuthority,
    TLSError,
    client_context,
    pinned_ca,
)
from elastic_mesh.control.token import create_token, read_token
from elastic_mesh.coordinator.config import CoordinatorConfig
from elastic_mesh.coordinator.run import is_loopback, make_token, start_coordinator
from elastic_mesh.transfer.chunks import TransferError, lay_out
from elastic_mesh.transfer.fetcher import ChunkFetcher, get_chunk
from elastic_mesh.transfer.server import ChunkServer
from tests.conftest import REPO
from tests.unit.test_coordinator import FACTS


@pytest.fixture()
def coordinator(tmp_path):
    server = start_coordinator(tmp_path / "coord", config=CoordinatorConfig(lease_s=8, heartbeat_s=0.5, poll_s=1.0),
                               tls=True)
    yield server
    server.stop()


def node_facts(procs: int = 1) -> tuple[dict, list[MemberIdentity]]:
    identities = [MemberIdentity() for _ in range(procs)]
    return {**FACTS, "procs_per_node": procs, "tls_public_keys": [i.public_pem for i in identities]}, identities


class RecordingProxy:
    """Forwards one TCP port to another and keeps every byte that passes: what anyone on the path sees."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.seen = target_port, bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.seen += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_auto_mode_is_plain_on_loopback_only():
    assert is_loopback("127.0.0.1:29400") and is_loopback("localhost:1") and is_loopback("[::1]:5")
    assert not is_loopback("10.0.0.2:29400") and not is_loopback("coordinator.example.org:29400")


def test_tokens_pin_the_certificate_and_a_node_joins_over_tls(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)
    info = read_token(token)
    assert info.tls_fp == coordinator.coordinator.authority.fingerprint and len(info.tls_fp) == 64
    client = CoordinatorClient.for_token(token, request_timeout_s=10, retry_s=5)
    facts, identities = node_facts(2)
    answer = client.join(token, name="a", **facts)
    assert client.tls is not None and len(answer["tls_certs"]) == 2
    for identity, cert in zip(identities, answer["tls_certs"]):
        identity.server_context(cert)  # a certificate for exactly this process's key
        # A node's session (and its servers) outlive the token it joined with.
        assert x509.load_pem_x509_certificate(cert.encode()).not_valid_after_utc.timestamp() > info.expires_at + 86400
    with pytest.raises(TLSError, match="another key"):
        identities[0].server_context(answer["tls_certs"][1])
    assert "error" not in client.post("/v1/heartbeat", {"telemetry": []})


def test_a_node_that_sends_no_keys_is_told_why(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)
    client = CoordinatorClient.for_token(token, request_timeout_s=10, retry_s=5)
    with pytest.raises(CoordinatorError, match="tls_public_keys"):
        client.join(token, name="old", **FACTS)
    with pytest.raises(CoordinatorError, match="PEM public key"):
        client.join(token, name="bad", **{**FACTS, "tls_public_keys": ["not a key"]})
    forged = create_token(b"x" * 32, f"127.0.0.1:{coordinator.port}", read_token(token).run_id, 60)
    with pytest.raises(CoordinatorError) as refused:  # the token is judged first, keys or not
        client.join(forged, name="forger", **FACTS)
    assert refused.value.status == 403


def test_nothing_secret_crosses_the_path_in_clear(tmp_path):
    """The same join and heartbeats through a recording proxy: plain HTTP shows the token and the
    session to anyone on the path, TLS shows neither."""
    seen = {}
    for tls in (False, True):
        server = start_coordinator(tmp_path / f"coord-{tls}", tls=tls)
        proxy = RecordingProxy(server.port)
        try:
            token = make_token(tmp_path / f"coord-{tls}", 60, address=f"127.0.0.1:{proxy.port}")
            client = CoordinatorClient.for_token(token, request_timeout_s=10, retry_s=5)
            facts = node_facts()[0] if tls else FACTS
            answer = client.join(token, name="n", **facts)
            client.post("/v1/heartbeat", {"telemetry": []})
            time.sleep(0.2)
            secrets = [token.split(".")[2].encode(), answer["session"].encode(), answer["transfer_key"].encode()]
            seen[tls] = [s in proxy.seen for s in secrets]
            assert len(proxy.seen) > 500
        finally:
            proxy.close()
            server.stop()
    assert seen[False] == [True, True, True]  # the control: the proxy does see them in clear
    assert seen[True] == [False, False, False]


def test_a_stand_in_for_the_coordinator_is_refused_before_anything_is_sent(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)
    impostor = start_coordinator(tmp_path / "impostor", tls=True)  # another run's certificate
    plain = start_coordinator(tmp_path / "plain", tls=False)
    try:
        for address, why in ((f"127.0.0.1:{impostor.port}", "not the .* this token names"),
                             (f"127.0.0.1:{plain.port}", "does not speak TLS")):
            client = CoordinatorClient(address, request_timeout_s=5, retry_s=30, tls_fp=read_token(token).tls_fp)
            started = time.monotonic()
            with pytest.raises(CoordinatorError, match=why):
                client.join(token, name="victim", **node_facts()[0])
            assert time.monotonic() - started < 5  # refused at once, not retried
        assert impostor.coordinator.state.nodes() == [] and plain.coordinator.state.nodes() == []
    finally:
        impostor.stop()
        plain.stop()
    with pytest.raises(TLSError):  # and a plain client gets nothing out of a TLS coordinator
        pinned_ca(f"127.0.0.1:{coordinator.port}", "0" * 64)
    conn = http.client.HTTPConnection("127.0.0.1", coordinator.port, timeout=5)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/status")
        conn.getresponse()


def test_chunk_servers_speak_tls_that_only_the_run_trusts(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)
    client = CoordinatorClient.for_token(token, request_timeout_s=10, retry_s=5)
    facts, (identity,) = node_facts()
    answer = client.join(token, name="a", **facts)
    server = ChunkServer("127.0.0.1", 0, answer["transfer_key"], keep={"snapshot": 1})
    server.tls = identity.server_context(answer["tls_certs"][0])
    weights = {"w": torch.randn(64, 1000)}
    server.publish(lay_out(3, weights, chunk_bytes=64 << 10), "snapshot")
    source = f"127.0.0.1:{server.port}"
    try:
        fetcher = ChunkFetcher([source], answer["transfer_key"], tmp_path / "got", timeout_s=10,
                               tls=client.tls_context())
        _, tensors, report = fetcher.fetch("snapshot", 3)
        assert torch.equal(tensors["w"], weights["w"]) and report.chunks > 1
        (tmp_path / "other").mkdir()
        foreign = client_context(RunAuthority.load_or_create(tmp_path / "other", "other").ca_pem)
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"):
            get_chunk(answer["transfer_key"], 5, source, "/v1/snapshot/3", tls=foreign)
        with pytest.raises((TransferError, OSError, http.client.HTTPException)):
            get_chunk(answer["transfer_key"], 5, source, "/v1/snapshot/3")  # plain HTTP to a TLS server
    finally:
        server.stop()


def test_broadcast_members_serve_each_other_over_tls(coordinator, tmp_path):
    settings = BroadcastSettings(chunk_mb=0.0625, host="127.0.0.1", timeout_s=5, stall_s=5)
    origin = BroadcastMember(make_token(tmp_path / "coord", 600, publish=True), "policy", tmp_path / "o", settings)
    worker = make_token(tmp_path / "coord", 600, role="worker", max_nodes=4)
    members = [BroadcastMember(worker, "policy", tmp_path / f"m{i}", settings) for i in range(2)]
    try:
        sent = {"w": torch.randn(200, 1000)}
        origin.publish(1, sent)
        first, _ = members[0].fetch()
        origin.server.before_chunk = lambda *a: (_ for _ in ()).throw(ConnectionError("origin gone"))
        second, report = members[1].fetch()  # from the first member's server, over TLS
        assert torch.equal(second.tensors()["w"], sent["w"])
        assert members[0].server.tls is not None and members[0].served_bytes() > 0
        # A broadcast member's certificate ends with the token it was issued under, not 30 days later.
        identity, client = MemberIdentity(), CoordinatorClient.for_token(worker, 10, 5, bearer=True)
        cert = client.post("/v1/broadcast/hello", {"tls_public_key": identity.public_pem})["tls_cert"]
        ends = x509.load_pem_x509_certificate(cert.encode()).not_valid_after_utc.timestamp()
        assert read_token(worker).expires_at - 5 <= ends <= read_token(worker).expires_at + 1
    finally:
        for m in [origin, *members]:
            m.stop()


LIFELINE_NODE = """
import json, sys, time
from elastic_mesh.control.client import CoordinatorClient, Heartbeat
from elastic_mesh.control.lifeline import LifeLine
client = CoordinatorClient.for_token(sys.argv[1], request_timeout_s=10, retry_s=5)
answer = client.join(sys.argv[1], name="k", **json.loads(sys.argv[2]))
Heartbeat(client, 0.5).start()
LifeLine(client.address, answer["node_id"], answer["session"], tls=client.tls_context()).start()
print(answer["name"], flush=True)
time.sleep(600)
"""


def test_the_lifeline_over_tls_reports_a_killed_process_at_once_and_can_be_replaced(coordinator, tmp_path):
    token = make_token(tmp_path / "coord", 60)
    proc = subprocess.Popen([sys.executable, "-c", LIFELINE_NODE, token, json.dumps(node_facts()[0])], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "k"
    time.sleep(0.5)
    proc.kill()
    started = time.monotonic()
    while next(n.state for n in coordinator.coordinator.state.nodes() if n.name == "k") != "dead":
        assert time.monotonic() - started < 2.0, "the killed process was not seen through its TLS lifeline"
        time.sleep(0.02)
    proc.wait()
    # A newer lifeline replaces an older one without a death (the coordinator tells the older one so).
    client = CoordinatorClient.for_token(token, request_timeout_s=10, retry_s=5)
    answer = client.join(token, name="r", **node_facts()[0])
    first = LifeLine(client.address, answer["node_id"], answer["session"], tls=client.tls_context()).start()
    time.sleep(0.3)
    second = LifeLine(client.address, answer["node_id"], answer["session"], tls=client.tls_context()).start()
    deadline = time.monotonic() + 5
    while first.refused is None:
        assert time.monotonic() < deadline, "the replaced lifeline was never told"
        time.sleep(0.05)
    assert "replaced" in first.refused
    assert next(n.state for n in coordinator.coordinator.state.nodes() if n.name == "r") == "active"
    client.post("/v1/leave", {})
    second.stop()


def test_the_rl_orchestrator_serves_tls_with_its_members_certificate_and_no_other_member_can_pass_for_it(
        coordinator, tmp_path):
    """prime.rl's orchestrator answers workers with the certificate the coordinator gave its broadcast
    member, which names the service its token names; a client that expects the orchestrator refuses any
    other member's certificate of the run before it sends its token (issue 50: accepted before)."""
    from elastic_mesh.control.http import JsonServer, TokenCheck

    settings = BroadcastSettings(host="127.0.0.1")
    worker = make_token(tmp_path / "coord", 600, role="worker")
    trust = CoordinatorClient.for_token(worker, 10, 5).tls_context()
    servers, members, asked = {}, [], []
    for name, service in (("orchestrator", "orchestrator"), ("impostor", "")):
        own = make_token(tmp_path / "coord", 600, role="worker", service=service)
        member = BroadcastMember(own, "policy", tmp_path / name, settings)
        check = TokenCheck(f"127.0.0.1:{coordinator.port}", read_token(own).run_id, tls_fp=read_token(own).tls_fp)
        server = JsonServer("127.0.0.1", 0, {"/v1/who": lambda token, body, name=name: asked.append(name) or {
            "token_id": token.token_id}}, check, tls=member.server.tls)
        server.start()
        servers[name], members = server, [*members, member]
    try:
        client = CoordinatorClient(f"127.0.0.1:{servers['orchestrator'].port}", 10, 5, bearer=worker, tls=trust,
                                   service="orchestrator")
        assert client.post("/v1/who", {})["token_id"] == read_token(worker).token_id
        with pytest.raises(CoordinatorError):  # plain HTTP gets nothing
            CoordinatorClient(f"127.0.0.1:{servers['orchestrator'].port}", 5, 0, bearer=worker).post(
                "/v1/who", {}, retry=False)
        posing = CoordinatorClient(f"127.0.0.1:{servers['impostor'].port}", 5, 0, bearer=worker, tls=trust,
                                   service="orchestrator")
        with pytest.raises(CoordinatorError, match="issued for no service, not for the orchestrator"):
            posing.post("/v1/who", {}, retry=False)
        assert asked == ["orchestrator"]  # the impostor heard no request, so no token
        with pytest.raises(ValueError, match="service 'Orch estrator' must be"):
            make_token(tmp_path / "coord", 600, role="worker", service="Orch estrator")
    finally:
        for server in servers.values():
            server.stop()
        for member in members:
            member.stop()


def test_an_orchestrator_whose_token_names_no_service_is_told_how_to_make_one(coordinator, tmp_path):
    from prime.rl.orchestrator.config import OrchestratorConfig
    from prime.rl.orchestrator.service import OrchestratorService

    with pytest.raises(SystemExit, match="--service orchestrator"):
        OrchestratorService.build(OrchestratorConfig(), make_token(tmp_path / "coord", 600, role="worker"),
                                  tmp_path / "run")
