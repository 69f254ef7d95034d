"""Broadcast: signed versions, a swarm of members over real sockets, and every refusal with its reason.

The coordinator and the members run in this process (threads, real HTTP servers on loopback); the
fault tests with separate processes are in tests/e2e/test_broadcast.py."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import torch

from elastic_mesh.broadcast.member import (
    BroadcastError,
    BroadcastMember,
    BroadcastSettings,
)
from elastic_mesh.broadcast.payload import files_as_tensors, write_files
from elastic_mesh.control.signing import RunSigner
from elastic_mesh.control.token import create_token, read_token
from elastic_mesh.coordinator.run import (
    _secret,
    make_token,
    revoke_token,
    start_coordinator,
)
from elastic_mesh.transfer.chunks import root_hash

SETTINGS = BroadcastSettings(chunk_mb=0.0625, host="127.0.0.1", timeout_s=5, stall_s=5)


@pytest.fixture
def run(tmp_path):
    server = start_coordinator(tmp_path / "coord")
    yield server, tmp_path
    server.stop()


def tokens(tmp_path, **kw):
    return make_token(tmp_path / "coord", 3600, **kw)


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def payload() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer.weight": torch.randn(300, 1000, generator=g), "layer.bias": torch.randn(1000, generator=g),
            "step": torch.tensor([7])}


def test_a_published_version_reaches_every_member_verified_and_members_serve_each_other(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    worker = tokens(tmp, role="worker", max_nodes=8)
    members = [BroadcastMember(worker, "policy", tmp / f"m{i}", SETTINGS) for i in range(4)]
    try:
        sent = payload()
        manifest = origin.publish(1, sent)
        assert manifest["root"] == root_hash(manifest["chunks"]) and len(manifest["chunks"]) > 16
        first, report = members[0].fetch()
        wait_until(lambda: origin.complete_copies(1) >= 1)
        assert first.complete and report.bytes_from == {origin.address or next(iter(report.bytes_from)): report.total_bytes}
        # The origin now stops answering: the others must get everything from the first member.
        origin.server.before_chunk = lambda *a: (_ for _ in ()).throw(ConnectionError("origin gone"))
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, members[i].fetch())) for i in (1, 2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i in (1, 2, 3):
            target, rep = results[i]
            got = target.tensors()
            assert all(torch.equal(got[k], v) for k, v in sent.items())
        assert members[0].served_bytes() > 0
        status = server.coordinator.status()["broadcast"]
        assert status[0]["version"] == 1 and status[0]["complete"] >= 2
    finally:
        for m in [origin, *members]:
            m.stop()


def test_forged_unsigned_and_foreign_manifests_are_refused(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    member = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "m", SETTINGS)
    try:
        origin.publish(1, payload())
        envelope = server.coordinator.broadcasts.envelope("policy", 1)
        forged = json.loads(json.dumps(envelope))
        forged["manifest"]["chunks"][0]["sha256"] = "0" * 64
        forged["manifest"]["root"] = root_hash(forged["manifest"]["chunks"])
        with pytest.raises(BroadcastError, match="signature does not match"):
            member.verified(forged)
        with pytest.raises(BroadcastError, match="unsigned"):
            member.verified({k: v for k, v in envelope.items() if k != "signature"})
        other = RunSigner.load_or_create(tmp / "other.pem")
        foreign = {k: envelope[k] for k in ("run_id", "kind", "manifest")}
        with pytest.raises(BroadcastError, match="signature does not match"):
            member.verified({**foreign, "signature": other.sign(foreign)})
        with pytest.raises(BroadcastError, match="no policy version 9"):
            member.manifest(9)
    finally:
        origin.stop()
        member.stop()


def test_tokens_decide_who_may_publish_and_fetch(run):
    server, tmp = run
    worker = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "w", SETTINGS)
    try:
        with pytest.raises(BroadcastError, match="no publish right"):
            worker.publish(1, payload())
    finally:
        worker.stop()
    with pytest.raises(BroadcastError, match="observer token reads the status only"):
        BroadcastMember(tokens(tmp, role="observer"), "policy", tmp / "o", SETTINGS)
    revoked = tokens(tmp, role="worker")
    revoke_token(tmp / "coord", read_token(revoked).token_id)
    with pytest.raises(BroadcastError, match="was revoked"):
        BroadcastMember(revoked, "policy", tmp / "r", SETTINGS)
    address = f"127.0.0.1:{server.port}"
    foreign = create_token(b"x" * 32, address, server.coordinator.run_id, 3600, "worker")
    with pytest.raises(BroadcastError, match="signature is invalid"):
        BroadcastMember(foreign, "policy", tmp / "f", SETTINGS)
    other_run = create_token(_secret(tmp / "coord"), address, "another-run", 3600, "worker")
    with pytest.raises(BroadcastError, match="another run"):
        BroadcastMember(other_run, "policy", tmp / "f", SETTINGS)
    # A token that names another signing key: the coordinator at its address is not the one it trusts.
    pinned = create_token(_secret(tmp / "coord"), address, server.coordinator.run_id, 3600, "worker",
                          key_fp="f" * 32)
    with pytest.raises(BroadcastError, match="not this run's coordinator"):
        BroadcastMember(pinned, "policy", tmp / "p", SETTINGS)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("POST", "/v1/broadcast/holders", body=json.dumps({"kind": "policy", "version": 1}))
    answer = conn.getresponse()
    assert answer.status == 401 and b"needs a join token" in answer.read()


def test_one_token_names_at_most_max_nodes_holders(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    shared = tokens(tmp, role="worker", max_nodes=1)
    members = [BroadcastMember(shared, "policy", tmp / f"m{i}", SETTINGS) for i in range(2)]
    try:
        origin.publish(1, payload())
        for m in members:
            m.fetch()  # both get their copy; only one of them may serve it
        time.sleep(1.0)
        answer = origin.client.post("/v1/broadcast/holders", {"kind": "policy", "version": 1})
        assert len(answer["holders"]) == 2  # the origin and one member
        with pytest.raises(Exception, match="its cap"):
            members[1].client.post("/v1/broadcast/have", {"kind": "policy", "version": 1, "port": 1, "chunks": "all"})
    finally:
        for m in [origin, *members]:
            m.stop()


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


def test_retention_keeps_the_newest_versions_and_versions_only_go_up(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    relay = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "relay",
                            SETTINGS.model_copy(update={"keep": 2}))
    try:
        for version in (1, 2, 3):
            origin.publish(version, {"v": torch.full((1000,), float(version))})
            target, _ = relay.fetch()
            assert target.version == version and target.tensors()["v"][0] == version
        assert sorted(relay.held) == [2, 3] and not (tmp / "relay" / "policy" / "v00000001").exists()
        with pytest.raises(BroadcastError, match="already holds policy version 2"):
            origin.publish(2, {"v": torch.zeros(10)})
        fresh_origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin2", SETTINGS)
        try:  # the coordinator is the judge for a publisher that never held it
            with pytest.raises(BroadcastError, match="not newer than the published 3"):
                fresh_origin.publish(2, {"v": torch.zeros(10)})
            assert fresh_origin.server.versions("policy") == []  # nothing left served
        finally:
            fresh_origin.stop()
    finally:
        origin.stop()
        relay.stop()


def test_an_interrupted_fetch_resumes_from_its_verified_chunks(run):
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    worker = tokens(tmp, role="worker")
    try:
        origin.publish(1, payload())
        first = BroadcastMember(worker, "policy", tmp / "m", SETTINGS, serve=False)
        served = []
        origin.server.before_chunk = lambda kind, version, index: served.append(index) or (
            len(served) > 10 and (_ for _ in ()).throw(ConnectionError("cut")))
        with pytest.raises(BroadcastError, match="verified chunks stay"):
            first.fetch()
        first.stop()
        kept = len(list((tmp / "m" / "policy" / "v00000001").glob("chunk_*")))
        assert 0 < kept < 30
        origin.server.before_chunk = None
        again = BroadcastMember(worker, "policy", tmp / "m", SETTINGS, serve=False)
        target, report = again.fetch()
        again.stop()
        assert target.complete and report.resumed_chunks == kept
    finally:
        origin.stop()


def test_files_round_trip_and_names_cannot_escape_the_output_folder(run, tmp_path):
    server, tmp = run
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 3000)
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    member = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "m", SETTINGS)
    try:
        tensors, meta = files_as_tensors([src])
        origin.publish(1, tensors, meta)
        target, _ = member.fetch()
        write_files(target, tmp_path / "out")
        assert (tmp_path / "out" / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
        target.manifest["meta"]["files"] = ["../escape"]
        target.manifest["tensors"][0]["name"] = "../escape"
        with pytest.raises(ValueError, match="outside"):
            write_files(target, tmp_path / "out")
    finally:
        origin.stop()
        member.stop()


def test_a_member_keeps_its_connections_from_one_version_to_the_next(run):
    """Versions follow each other from the same peers: the second download reuses the first's connections
    (no new handshakes, and the chunk server's BBR keeps their pace after the idle gap)."""
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    member = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "m", SETTINGS)
    try:
        origin.publish(1, payload())
        member.fetch(1)
        first = [conn for kept in member._conns._idle.values() for conn, _ in kept]  # held: ids stay unique
        assert first
        origin.publish(2, payload())
        member.fetch(2)
        second = [conn for kept in member._conns._idle.values() for conn, _ in kept]
        assert {id(c) for c in first} & {id(c) for c in second}
    finally:
        for m in (origin, member):
            m.stop()


@pytest.mark.parametrize("overlap", [1, 2])
def test_a_follower_starts_a_new_version_while_the_last_ones_chunks_still_arrive_only_with_overlap(run, overlap):
    """follow_overlap=2: version 2, announced while version 1's slowed chunks still arrive, starts at once
    (its download begins right after its announcement); with 1 it waits for version 1 to finish. Both
    arrive either way."""
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    member = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "m", SETTINGS.model_copy(
        update={"follow_overlap": overlap}))
    origin.server.before_chunk = lambda kind, version, index: time.sleep(0.15 if version == 1 else 0.0)
    events, lock = [], threading.Lock()

    def note(what: str, version: int) -> None:
        with lock:
            events.append((what, version))
    follower = threading.Thread(target=member.follow, daemon=True, kwargs={
        "on_announced": lambda manifest: note("announced", manifest["version"]),
        "on_version": lambda target, report: note("complete", target.version)})
    try:
        origin.publish(1, payload())  # 20 chunks: 3 s at 0.15 s a chunk
        follower.start()
        wait_until(lambda: ("announced", 1) in events)
        time.sleep(0.3)
        origin.publish(2, payload())
        wait_until(lambda: ("complete", 2) in events and ("complete", 1) in events, 30)
        if overlap == 2:
            assert events.index(("announced", 2)) < events.index(("complete", 1)), events
        else:
            assert events.index(("complete", 1)) < events.index(("announced", 2)), events
        assert {v for what, v in events if what == "complete"} == {1, 2} and len(events) == 4, events
    finally:
        for m in (origin, member):
            m.stop()


def test_a_new_version_comes_with_its_holders_and_a_publish_costs_one_request(run):
    """The wait answer names who holds the version (a follower starts its download from it), and the
    publish answer carries the signed manifest (the publisher asks for nothing more)."""
    server, tmp = run
    origin = BroadcastMember(tokens(tmp, publish=True), "policy", tmp / "origin", SETTINGS)
    member = BroadcastMember(tokens(tmp, role="worker"), "policy", tmp / "m", SETTINGS)
    asked = []
    post = origin.client.post
    origin.client.post = lambda path, body, **kw: (asked.append(path), post(path, body, **kw))[1]
    try:
        manifest = origin.publish(1, payload())
        # (its announcer's `have` runs in a thread of its own)
        assert [p for p in asked if p != "/v1/broadcast/have"] == ["/v1/broadcast/publish"]
        assert manifest == member.manifest(1)
        answer = member.client.post("/v1/broadcast/wait", {"kind": "policy", "after": -1})
        assert [(h["origin"], h["chunks"], h["address"].endswith(f":{origin.server.port}"))
                for h in answer["holders"]] == [(True, "all", True)]
        target, report = member.fetch(manifest=member.verified(answer["envelope"]), holders=answer["holders"])
        assert target.complete
    finally:
        for m in (origin, member):
            m.stop()


def test_the_holder_view_is_refreshed_fast_in_a_downloads_first_second_then_at_refresh_s():
    """A small version's download is over within a second and waits mostly on learning who holds what;
    a long download needs no faster view, and many members asking 20 times a second would load the
    coordinator. (A stand-in member: only its coordinator client is asked, and it counts the asks.)"""
    from types import SimpleNamespace

    from elastic_mesh.broadcast.member import FIRST_S, _HolderView

    asks: list[float] = []

    def post(path, body, retry=True):
        asks.append(time.monotonic())
        return {"holders": []}

    member = SimpleNamespace(kind="policy", address="", client=SimpleNamespace(post=post),
                             settings=BroadcastSettings(refresh_first_s=0.05, refresh_s=0.5))
    view = _HolderView(member, 1, None)
    started = asks[0]
    time.sleep(FIRST_S + 1.5)
    view.stop()
    first = [t for t in asks if t - started < FIRST_S]
    later = [t for t in asks if FIRST_S + 0.5 <= t - started < FIRST_S + 1.5]
    assert len(first) >= 8, len(first)  # every 50 ms: ~20 (refresh_s alone: 2)
    assert len(later) <= 4, len(later)  # every 0.5 s: ~2 (refresh_first_s throughout: ~20)



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
