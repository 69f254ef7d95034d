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

    from elastic_mesh.broadcast.holder_view import FIRST_S, HolderView

    asks: list[float] = []

    def post(path, body, retry=True):
        asks.append(time.monotonic())
        return {"holders": []}

    member = SimpleNamespace(kind="policy", address="", client=SimpleNamespace(post=post),
                             settings=BroadcastSettings(refresh_first_s=0.05, refresh_s=0.5))
    view = HolderView(member, 1, None)
    started = asks[0]
    time.sleep(FIRST_S + 1.5)
    view.stop()
    first = [t for t in asks if t - started < FIRST_S]
    later = [t for t in asks if FIRST_S + 0.5 <= t - started < FIRST_S + 1.5]
    assert len(first) >= 8, len(first)  # every 50 ms: ~20 (refresh_s alone: 2)
    assert len(later) <= 4, len(later)  # every 0.5 s: ~2 (refresh_first_s throughout: ~20)
