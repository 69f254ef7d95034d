"""Broadcast under attack (issue 50): bad chunks, signed evidence and framing, report spam, holders that
never answer. The coordinator and the members run in this process, over real sockets on loopback."""

from __future__ import annotations

import time

import pytest
import torch

from elastic_mesh.broadcast.member import BroadcastMember
from elastic_mesh.control.signing import RunSigner
from elastic_mesh.control.token import read_token
from elastic_mesh.coordinator.run import start_coordinator
from tests.unit.test_broadcast import SETTINGS, payload, tokens, wait_until


@pytest.fixture
def run(tmp_path):
    server = start_coordinator(tmp_path / "coord")
    yield server, tmp_path
    server.stop()


def test_a_corrupt_source_is_banned_named_and_reported_and_the_download_completes(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    liar = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "liar", SETTINGS)
    honest = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "honest", SETTINGS)
    try:
        sent = payload()
        origin.publish(1, sent)
        liar.fetch()
        wait_until(lambda: origin.complete_copies(1) >= 1)  # the coordinator names the liar as a holder
        liar.server.chunk_filter = lambda kind, version, index, data: bytes(b ^ 0x55 for b in data[:64]) + data[64:]
        target, report = honest.fetch(only=lambda h: h["address"] in (liar.address, origin.address))
        assert all(torch.equal(target.tensors()[k], v) for k, v in sent.items())
        assert report.corrupt and all(c.endswith(liar.address) for c in report.corrupt), (report, liar.address, origin.address)
        assert liar.address not in report.bytes_from
        events = " ".join(e["text"] for e in server.coordinator.status()["events"])
        assert f"from {liar.address} did not match its signed hash" in events
        # One report was enough: it carried the liar's own signed statement of the bytes it sent.
        assert "banned from serving policy: its own signed statement" in events
        with pytest.raises(Exception, match="is banned from serving policy"):
            liar.client.post("/v1/broadcast/have", {"kind": "policy", "version": 1, "port": liar.server.port,
                                                    "chunks": "all"})
    finally:
        for m in (origin, liar, honest):
            m.stop()


def test_bytes_a_source_did_not_sign_ban_nobody_and_no_reporter_can_frame_an_honest_member(run):
    """Evidence, not votes (issue 50): a source whose signature is not of the bytes that arrived (altered on
    the way, or a liar that signs the right hash) is a failed transfer, not a ban; and a token holder cannot
    turn an honest member's signed statements, or a credential of its own making, into a ban."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from elastic_mesh.transfer.evidence import ChunkSigner, issue_credential
    from elastic_mesh.transfer.fetcher import get_chunk

    server, tmp = run
    origin_token = tokens(tmp, publish=True)
    origin = BroadcastMember(origin_token, "policy", tmp / "origin", SETTINGS)
    liar = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "liar", SETTINGS)
    honest = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "honest", SETTINGS)
    framer = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "framer", SETTINGS, serve=False)
    try:
        origin.publish(1, payload())
        liar.fetch()
        wait_until(lambda: origin.complete_copies(1) >= 1)
        # Sends other bytes under its signature of the right ones: what a link that flips bits would look like.
        liar.server.signature = lambda kind, item, index, data: liar.server.signer.sign(
            kind, item.version, index, item.manifest["chunks"][index]["sha256"])
        liar.server.chunk_filter = lambda kind, version, index, data: bytes(b ^ 0x55 for b in data[:64]) + data[64:]
        target, report = honest.fetch(only=lambda h: h["address"] in (liar.address, origin.address))
        assert target.complete and report.corrupt and liar.address not in report.bytes_from
        events = " ".join(e["text"] for e in server.coordinator.status()["events"])
        assert f"from {liar.address} did not match its signed hash" in events and "no ban" in events
        assert "banned from serving" not in events
        assert liar.client.post("/v1/broadcast/have", {"kind": "policy", "version": 1, "port": liar.server.port,
                                                       "chunks": "all"})["status"] == "ok"

        # The framer holds the origin's real signed statement of a good chunk.
        source = next(h["address"] for h in framer.client.post("/v1/broadcast/holders", {"kind": "policy", "version": 1})[
            "holders"] if h["origin"])
        good = get_chunk(framer.key, 5, source, "/v1/policy/1/chunk/0", tls=framer.client.tls)
        assert good.proof is not None
        manifest_hash = origin.held[1].manifest["chunks"][0]["sha256"]
        forged_signer = ChunkSigner()
        forged = issue_credential(RunSigner(Ed25519PrivateKey.generate()), framer.run_id,
                                  read_token(origin_token).token_id, forged_signer.public_hex, time.time() + 60)
        attempts = {
            "statement is of good bytes": {**good.proof.as_json(), "sha256": manifest_hash},
            "not its sender's statement": {**good.proof.as_json(), "sha256": "ab" * 32},
            "not the run's": {"signature": forged_signer.sign("policy", 1, 0, "ab" * 32).hex(), "credential": forged,
                              "sha256": "ab" * 32},
            "names no sha256": {**good.proof.as_json()},
        }
        for i, (why, evidence) in enumerate(attempts.items()):
            answer = framer.client.post("/v1/broadcast/report", {"kind": "policy", "version": 1, "chunk": 0,
                                                                 "source": f"{source}#{i}", "evidence": evidence})
            assert answer["proven"] is False and why in answer["detail"], (why, answer)
        origin.publish(2, payload())  # the origin still serves: nothing above banned it
        assert honest.fetch()[0].complete
    finally:
        for m in (origin, liar, honest, framer):
            m.stop()


def test_reports_cannot_ban_the_publisher_name_unpublished_versions_or_pile_up(run):
    """Issue 50's attacks on the report route, as two worker tokens would make them: the trainer's address
    reported for versions not yet published (its next publish was refused and the run stopped), the
    published version's origin reported by both, report spam, and a `have` naming another's address."""
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    a, b = (BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / name, SETTINGS) for name in ("a", "b"))
    try:
        origin.publish(1, payload())
        source = origin.address or origin.client.post("/v1/broadcast/holders", {"kind": "policy", "version": 1})[
            "holders"][0]["address"]
        for version in (2, 3):
            for m in (a, b):
                with pytest.raises(Exception, match="must be about a published version"):
                    m.client.post("/v1/broadcast/report", {"kind": "policy", "version": version, "source": source})
        for m in (a, b):
            answer = m.client.post("/v1/broadcast/report", {"kind": "policy", "version": 1, "source": source,
                                                            "reason": "forged\nline"})
            assert answer["banned"] is False and answer["proven"] is False, answer
        origin.publish(2, payload())  # the run goes on: the trainer's address is neither banned nor refused
        assert a.fetch()[0].complete
        events = [e["text"] for e in server.coordinator.status()["events"]]
        assert any("forged\\nline" in e for e in events) and not any(e.endswith("line") and "forged" not in e for e in events)
        for i in range(8):  # one token names at most 8 sources of a version; repeats add nothing
            a.client.post("/v1/broadcast/report", {"kind": "policy", "version": 2, "source": f"10.0.0.{i}:1"})
        before = len(server.coordinator.status()["events"])
        a.client.post("/v1/broadcast/report", {"kind": "policy", "version": 2, "source": "10.0.0.0:1"})
        assert len(server.coordinator.status()["events"]) == before
        with pytest.raises(Exception, match="the most one token may"):
            a.client.post("/v1/broadcast/report", {"kind": "policy", "version": 2, "source": "10.0.0.9:1"})
        host, port = source.rsplit(":", 1)
        with pytest.raises(Exception, match="by another token"):  # the origin's entry is the origin's
            b.client.post("/v1/broadcast/have", {"kind": "policy", "version": 2, "host": host, "port": int(port),
                                                 "chunks": "all"})
    finally:
        for m in (origin, a, b):
            m.stop()


def test_a_holder_that_claims_every_chunk_and_never_answers_is_asked_no_more_once_a_request_of_it_failed(run):
    """Issue 50: a worker token names a socket that accepts and never answers as a holder of every chunk
    of each new version. Honest downloads waited out the 10 s time-out on it (0.04 -> 11 s a version);
    now the seeder is asked beside it, its requests end at the first-byte deadline, and in later
    downloads it is a suspect nobody asks while someone else holds the chunks."""
    import socket

    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    honest = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "honest", SETTINGS)
    rogue = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "rogue", SETTINGS, serve=False)
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(64)
    sink.setblocking(False)
    bogus = f"127.0.0.1:{sink.getsockname()[1]}"
    held = []

    def asked() -> int:
        """Connections the honest member opened to the bogus holder since the last call."""
        before = len(held)
        while True:
            try:
                held.append(sink.accept()[0])
            except BlockingIOError:
                return len(held) - before
    try:
        took, connections = [], []
        for version in (1, 2, 3):
            origin.publish(version, payload())
            rogue.client.post("/v1/broadcast/have", {"kind": "policy", "version": version, "host": "127.0.0.1",
                                                     "port": sink.getsockname()[1], "chunks": "all"})
            started = time.monotonic()
            target, report = honest.fetch(version)
            took.append(time.monotonic() - started)
            assert target.complete and bogus not in report.bytes_from
            connections.append(asked())
            time.sleep(2.2 if version == 1 else 0.2)  # its first requests reach their first-byte deadline
        assert all(t < SETTINGS.timeout_s / 2 for t in took), took  # never the whole time-out
        # Asked in the first download; its requests ended at the first-byte deadline (2 s) without a byte, so
        # it is a suspect: not asked at all while the origin holds everything.
        assert connections[0] >= 1 and connections[2] == 0, connections
    finally:
        for conn in held:
            conn.close()
        sink.close()
        for m in (origin, honest, rogue):
            m.stop()
