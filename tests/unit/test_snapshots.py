"""Snapshots over real HTTP: several sources at once, corrupt chunks, a source SIGKILLed mid-transfer,
a joiner restarted mid-download, wrong keys, disagreeing sources."""

from __future__ import annotations

import base64
import http.client
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from elastic_mesh.transfer.chunk_dir import ChunkDir
from elastic_mesh.transfer.chunks import Chunked, Deferred, TransferError, lay_out
from elastic_mesh.transfer.fetcher import ChunkFetcher, Download, FetchReport, get_chunk
from elastic_mesh.transfer.server import ChunkServer
from elastic_mesh.transfer.sources import SourcePicker

KEY = "k" * 32
CHUNK = 64 << 10
KEEP = {"snapshot": 2}


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"outer": torch.randn(300_000, generator=g), "momentum": torch.randn(200_001, generator=g),
            "counters": torch.tensor([7, 12], dtype=torch.int64), "empty": torch.zeros(0)}


def serve(n: int, seed: int = 0, delay: float = 0.0) -> list[ChunkServer]:
    snapshot = lay_out(5, state(seed), {"outer_step": 5}, chunk_bytes=CHUNK)
    servers = [ChunkServer("127.0.0.1", 0, KEY, keep=KEEP) for _ in range(n)]
    for s in servers:
        s.publish(snapshot, "snapshot")
        if delay:  # an emulated slow uplink, through the server's seam for faults
            s.before_chunk = lambda kind, version, index: time.sleep(delay)
    return servers


def addresses(servers) -> list[str]:
    return [f"127.0.0.1:{s.port}" for s in servers]


def assert_state(tensors) -> None:
    for name, expected in state().items():
        assert torch.equal(tensors[name], expected), name


def test_fetches_from_three_sources_at_once(tmp_path):
    servers = serve(3)
    try:
        manifest, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path).fetch("snapshot")
    finally:
        for s in servers:
            s.stop()
    assert manifest["version"] == 5 and manifest["meta"] == {"outer_step": 5}
    assert_state(tensors)
    # Every source was used (untried sources are tried first); how much each served follows its measured
    # rate (test_the_picker_prefers_the_faster_source), which on a loaded machine is anyone's guess.
    assert len(report.bytes_from) == 3 and sum(report.bytes_from.values()) == report.total_bytes


def test_the_picker_prefers_the_faster_source_and_still_explores():
    from elastic_mesh.transfer.sources import SourcePicker

    picker = SourcePicker(streams_per_source=4, explore=0.1, seed=1)
    for source, seconds in (("fast", 0.1), ("slow", 1.0)):  # one chunk each: both measured
        assert picker.pick([source]) == source
        picker.done(source, 1 << 20, seconds)
    picks = []
    for _ in range(1000):
        source = picker.pick(["fast", "slow"])
        picks.append(source)
        picker.done(source, 1 << 20, 0.1 if source == "fast" else 1.0)
    assert 0.85 < picks.count("fast") / len(picks) < 0.99  # mostly the fast one, the slow one re-measured
    picker.ban("fast", "sent a bad chunk")
    assert picker.pick(["fast", "slow"]) == "slow"


class CountingServer(ChunkServer):
    """Counts the TCP connections it accepts."""

    accepted = 0

    def get_request(self):
        self.accepted += 1
        return super().get_request()


def test_chunks_travel_over_kept_connections(tmp_path):
    snapshot = lay_out(5, state(), chunk_bytes=CHUNK)  # ~2 MB: 31 chunks
    server = CountingServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(snapshot, "snapshot")
    try:
        fetcher = ChunkFetcher(addresses([server]), KEY, tmp_path, streams_per_source=2)
        _, tensors, report = fetcher.fetch("snapshot")
    finally:
        server.stop()
    assert_state(tensors)
    # One connection for the manifest, then one per stream, not one per chunk.
    assert report.chunks > 20 and server.accepted <= 1 + 2, server.accepted


def test_a_kept_connection_the_server_closed_is_reopened_without_blaming_the_source(tmp_path):
    server = serve(1)[0]
    # Idle connections are closed by the server after 0.2 s (30 s in production).
    server.limits = server.limits.model_copy(update={"idle_timeout_s": 0.2})
    fetcher = ChunkFetcher(addresses([server]), KEY, tmp_path)
    conns: dict = {}
    try:
        first = fetcher._get(addresses([server])[0], "/v1/snapshot/5/chunk/0", conns)
        time.sleep(0.6)
        again = fetcher._get(addresses([server])[0], "/v1/snapshot/5/chunk/0", conns)
    finally:
        server.stop()
    assert first == again and len(first.data) == CHUNK


def test_a_corrupt_chunk_is_fetched_from_another_source(tmp_path):
    servers = serve(2)
    bad = servers[0]
    snapshot = bad.get("snapshot", "latest")
    tampered = bytearray(snapshot.blob)
    for offset in range(100, len(tampered), CHUNK):
        tampered[offset] ^= 0xFF  # one byte of every chunk, on this source only (it is tried first: untried)
    bad.publish(Chunked(snapshot.version, snapshot.manifest, bytes(tampered)), "snapshot")
    try:
        _, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path).fetch("snapshot")
    finally:
        for s in servers:
            s.stop()
    assert_state(tensors)
    # Banned at its first bad chunk: named once (or twice, if two streams asked it at once), served nothing kept.
    assert 1 <= len(report.corrupt) <= 2 and all(c.endswith(addresses(servers)[0]) for c in report.corrupt)
    assert addresses(servers)[0] not in report.bytes_from


SOURCE = """
import sys, time, torch
from tests.unit.test_snapshots import serve
server = serve(1, delay=float(sys.argv[1]))[0]
print(server.port, flush=True)
time.sleep(600)
"""


def source_process(delay: float) -> tuple[subprocess.Popen, str]:
    from tests.conftest import REPO

    proc = subprocess.Popen([sys.executable, "-c", SOURCE, str(delay)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return proc, f"127.0.0.1:{int(proc.stdout.readline())}"


def test_a_source_killed_mid_transfer_is_replaced_by_the_others(tmp_path):
    dying, address = source_process(delay=0.05)
    healthy = serve(1, delay=0.05)
    try:
        fetcher = ChunkFetcher([address, *addresses(healthy)], KEY, tmp_path, timeout_s=5)
        killer = __import__("threading").Timer(0.3, dying.send_signal, (signal.SIGKILL,))
        killer.start()
        _, tensors, report = fetcher.fetch("snapshot")
    finally:
        dying.kill()
        for s in healthy:
            s.stop()
    assert_state(tensors)
    assert 0 < report.bytes_from.get(address, 0) < report.total_bytes  # it served some, then died
    assert report.failed and all(address in f for f in report.failed)


FETCH = """
import sys
from elastic_mesh.transfer.fetcher import ChunkFetcher
ChunkFetcher(sys.argv[1].split(","), "%s", sys.argv[2], streams_per_source=1).fetch("snapshot")
""" % KEY


def test_a_joiner_restarted_mid_download_resumes(tmp_path):
    from tests.conftest import REPO

    servers = serve(2, delay=0.05)
    try:
        joiner = subprocess.Popen([sys.executable, "-c", FETCH, ",".join(addresses(servers)), str(tmp_path)], cwd=REPO)
        directory = tmp_path / "snapshot_00000005"
        deadline = time.monotonic() + 60
        while len(list(directory.glob("chunk_*"))) < 8:
            assert time.monotonic() < deadline and joiner.poll() is None
            time.sleep(0.02)
        joiner.kill()  # mid-download
        joiner.wait()
        on_disk = len(list(directory.glob("chunk_*")))
        _, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path).fetch("snapshot")
    finally:
        for s in servers:
            s.stop()
    assert_state(tensors)
    assert report.resumed_chunks == on_disk and 8 <= on_disk < report.chunks
    assert sum(report.bytes_from.values()) < report.total_bytes  # did not start over


def test_wrong_key_and_no_sources_are_clear_errors(tmp_path):
    servers = serve(1)
    try:
        with pytest.raises(TransferError, match="none of the sources"):
            ChunkFetcher(addresses(servers), "wrong", tmp_path).fetch("snapshot")
    finally:
        servers[0].stop()
    with pytest.raises(TransferError, match="none of the sources"):
        ChunkFetcher(["127.0.0.1:1"], KEY, tmp_path, timeout_s=2).fetch("snapshot")


def test_a_source_with_different_content_is_outvoted(tmp_path):
    honest, liar = serve(2), serve(1, seed=99)
    try:
        _, tensors, report = ChunkFetcher(addresses(honest + liar), KEY, tmp_path).fetch("snapshot")
    finally:
        for s in honest + liar:
            s.stop()
    assert_state(tensors)
    assert addresses(liar)[0] not in report.bytes_from


def test_mixed_fetch_takes_each_chunk_from_some_source_checked_against_that_sources_manifest(tmp_path):
    """Nodes' own optimizer moments: same layout, different bytes. Every chunk of the result is the same
    chunk of one of the sources and all sources serve some; a source whose bytes do not match its own
    manifest is caught chunk by chunk and its chunks are taken from the others."""
    seeds = (1, 2, 3)
    blobs = [lay_out(5, state(seed), {"outer_step": 5}, chunk_bytes=CHUNK).blob for seed in seeds]
    servers = [server for seed in seeds for server in serve(1, seed=seed)]

    def fetch(work_dir) -> tuple[bytes, object]:
        _, tensors, report = ChunkFetcher(addresses(servers), KEY, work_dir).fetch("snapshot", mixed=True)
        return lay_out(5, tensors, chunk_bytes=CHUNK).blob, report

    def owners(blob: bytes, chunk: int) -> set[int]:
        return {k for k, b in enumerate(blobs) if blob[chunk * CHUNK:(chunk + 1) * CHUNK] == b[chunk * CHUNK:(chunk + 1) * CHUNK]}
    try:
        mixed, report = fetch(tmp_path / "a")
        assert len(mixed) == len(blobs[0]) and len(report.bytes_from) == 3
        assert all(owners(mixed, c) for c in range(report.chunks))
        snapshot = servers[0].get("snapshot", "latest")
        servers[0].publish(Chunked(snapshot.version, snapshot.manifest, bytes(b ^ 0xFF for b in snapshot.blob)), "snapshot")
        mixed, report = fetch(tmp_path / "b")
    finally:
        for s in servers:
            s.stop()
    assert report.corrupt and all(addresses(servers)[0] in c for c in report.corrupt), report.corrupt
    assert all(owners(mixed, c) <= {1, 2} and owners(mixed, c) for c in range(report.chunks))


def test_a_deferred_snapshot_is_built_once_when_first_fetched_and_serves_the_same_bytes(tmp_path):
    built = []

    def counted(snapshot: Chunked) -> Chunked:
        built.append(snapshot.version)
        return snapshot
    servers = [ChunkServer("127.0.0.1", 0, KEY, keep=KEEP) for _ in range(2)]
    try:
        for s in servers:
            s.publish(Deferred(5, state(), {"outer_step": 5}, CHUNK, transform=counted), "snapshot")
        assert built == [] and servers[0].versions("snapshot") == [5]  # published, not yet laid out or hashed
        manifest, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path).fetch("snapshot")
    finally:
        for s in servers:
            s.stop()
    assert built == [5, 5], built  # once per source, though both served many chunks to several streams
    assert manifest == lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK).manifest
    assert_state(tensors)
    with pytest.raises(TypeError, match="complex64"):  # a bad tensor fails its publisher, not a peer later
        Deferred(1, {"z": torch.zeros(2, dtype=torch.complex64)})


def test_a_snapshot_being_fetched_outlives_newer_ones():
    server = ChunkServer("127.0.0.1", 0, KEY, keep={"snapshot": 2}, pin_s=60)
    try:
        for step in (1, 2):
            server.publish(lay_out(step, {"x": torch.zeros(4)}), "snapshot")
        assert server.get("snapshot", "1") is not None  # a joiner starts fetching step 1
        for step in (3, 4, 5):
            server.publish(lay_out(step, {"x": torch.zeros(4)}), "snapshot")
        assert server.versions("snapshot") == [1, 4, 5]  # 2 and 3 nobody read: evicted; 1 is in use
        server.pin_s = 0
        server.publish(lay_out(6, {"x": torch.zeros(4)}), "snapshot")
        assert server.versions("snapshot") == [5, 6]
    finally:
        server.stop()


def test_a_standing_request_is_answered_with_the_first_chunk_the_relay_verifies(tmp_path):
    """A relay still fetching holds a peer's fresh?wait_ms request until it verifies a chunk the peer
    wants (then sends that one at once), and answers 204 when none came within the wait."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    relay = ChunkDir(tmp_path / "relay", snapshot.manifest)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(relay, "snapshot")
    wanted = bytearray((relay.chunks + 7) // 8)
    wanted[0] = 0b110  # chunks 1 and 2

    def ask(wait_ms: int) -> tuple[int, bytes, float]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        began = time.monotonic()
        conn.request("GET", f"/v1/snapshot/5/fresh/{base64.urlsafe_b64encode(bytes(wanted)).decode().rstrip('=')}"
                            f"?wait_ms={wait_ms}", headers={"X-Mesh-Transfer-Key": KEY})
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - began

    try:
        status, body, took = ask(300)
        assert status == 204 and body == b"" and took >= 0.25  # nothing arrived: answered after the wait
        relay.put(0, snapshot.chunk(0))  # not wanted: the request below keeps waiting
        answer = {}
        asking = threading.Thread(target=lambda: answer.update(zip(("status", "body", "took"), ask(4000))))
        asking.start()
        time.sleep(0.3)
        relay.put(2, bytes(snapshot.chunk(2)))
        arrived = time.monotonic()
        asking.join(10)
        assert answer["status"] == 200 and struct.unpack(">q", answer["body"][:8])[0] == 2
        assert answer["body"][8:] == bytes(snapshot.chunk(2))
        assert time.monotonic() - arrived < 1.0 and answer["took"] < 3.0  # sent when it arrived, not at the end
    finally:
        server.stop()


def test_a_download_takes_chunks_from_a_peer_the_moment_the_peer_verifies_them(tmp_path):
    """Download with wait_s: a peer whose bitmap is still empty gets a standing request, so a chunk the
    peer verifies reaches this side with no refresh of who holds what (the holder view here never changes)."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    peer_dir = ChunkDir(tmp_path / "peer", snapshot.manifest)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(peer_dir, "snapshot")
    peer = f"127.0.0.1:{server.port}"
    target = ChunkDir(tmp_path / "me", snapshot.manifest)
    report = FetchReport(5, snapshot.manifest["total_bytes"], target.chunks)
    empty = bytes((target.chunks + 7) // 8)

    def feed() -> None:  # the peer verifies its chunks one by one, as if from an origin this side cannot reach
        for index in range(target.chunks):
            time.sleep(0.01)
            peer_dir.put(index, bytes(snapshot.chunk(index)))

    feeder = threading.Thread(target=feed)
    try:
        feeder.start()
        Download(lambda src, path, conns, first=None: get_chunk(KEY, 10, src, path, conns, first_byte_s=first), target, "snapshot",
                 lambda: {peer: empty}, SourcePicker(2), report, streams=4, stall_s=30, wait_s=2.0).run()
    finally:
        feeder.join()
        server.stop()
    assert target.complete and report.bytes_from == {peer: snapshot.manifest["total_bytes"]}
    assert_state(target.tensors())


def test_a_seeder_asked_for_new_chunks_only_sends_each_once_until_resend_after_s():
    """only_new: while the chunks it sent are on their way through the swarm a seeder declines (the
    followers pass them on); after resend_after_s it sends again (the member it went to may be gone)."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP, resend_after_s=0.3)
    try:
        everything = b"\xff" * ((len(snapshot.manifest["chunks"]) + 7) // 8)
        sent = [server.least_sent("snapshot", snapshot, everything, only_new=True)
                for _ in snapshot.manifest["chunks"]]
        assert sorted(sent) == list(range(len(snapshot.manifest["chunks"])))  # each once
        assert server.least_sent("snapshot", snapshot, everything, only_new=True) is None
        assert server.least_sent("snapshot", snapshot, everything) is not None  # without the flag: a second copy
        time.sleep(0.35)
        assert server.least_sent("snapshot", snapshot, everything, only_new=True) is not None
    finally:
        server.stop()


def test_a_seeder_sends_one_requester_a_chunk_once_however_many_streams_ask():
    """A member's streams ask with the same bitmap at the same moment: each gets a different chunk, and
    with all of them on their way to it the answer is "nothing yet" (204), not a second copy; another
    member still gets any chunk, and the same member gets one again after resend_after_s."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP, resend_after_s=0.3)
    try:
        n = len(snapshot.manifest["chunks"])
        everything = b"\xff" * ((n + 7) // 8)
        sent = [server.least_sent("snapshot", snapshot, everything, requester="10.0.0.1") for _ in range(n)]
        assert sorted(sent) == list(range(n))
        assert server.least_sent("snapshot", snapshot, everything, requester="10.0.0.1") is None
        assert server.holds_any(snapshot, everything)  # so the handler answers 204, not 404
        assert server.least_sent("snapshot", snapshot, everything, requester="10.0.0.2") is not None
        time.sleep(0.35)
        assert server.least_sent("snapshot", snapshot, everything, requester="10.0.0.1") is not None
    finally:
        server.stop()


def _requests_counted(servers, slow: dict[int, float], pace_s: float) -> list[int]:
    """Every chunk request the servers see, in order; the first request of each chunk in `slow` takes
    that long (a source that stalls on it), every other pace_s (a link)."""
    asked: list[int] = []
    lock = threading.Lock()

    def before(kind, version, index):
        with lock:
            first = index not in asked
            asked.append(index)
        time.sleep(slow.get(index, pace_s) if first else pace_s)

    for s in servers:
        s.before_chunk = before
    return asked


def test_the_endgame_asks_a_second_source_only_for_a_late_chunk(tmp_path):
    """The last chunks in flight at the usual pace are not asked again elsewhere (a duplicate costs the
    links as much as the chunk); one that is late is, and the download does not wait for its source."""
    servers = serve(2)
    try:
        asked = _requests_counted(servers, {}, pace_s=0.1)
        _, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path / "even").fetch("snapshot")
        assert_state(tensors)
        assert sorted(asked) == list(range(report.chunks))  # each chunk asked for once

        asked = _requests_counted(servers, {3: 5.0}, pace_s=0.05)
        started = time.monotonic()
        _, tensors, report = ChunkFetcher(addresses(servers), KEY, tmp_path / "stall").fetch("snapshot")
        assert_state(tensors)
        assert time.monotonic() - started < 3.0, (asked, report)  # not held up by the stalled request of chunk 3
        assert asked.count(3) == 2
    finally:
        for s in servers:
            s.stop()


def test_a_chunk_server_caps_connections_per_address_and_cuts_requests_that_never_arrive(tmp_path):
    """Issue 50: chunk servers stand on the hardened core. Idle connections over the per-address cap are
    closed at once; a request that never arrives whole is cut at its deadline; honest fetches go on."""
    import socket

    from elastic_mesh.control.service import ServiceLimits

    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP,
                         limits=ServiceLimits(max_connections_per_peer=4, read_timeout_s=0.5, idle_timeout_s=0.5))
    server.publish(snapshot, "snapshot")
    idle = []
    try:
        for _ in range(4):
            idle.append(socket.create_connection(("127.0.0.1", server.port)))
        time.sleep(0.1)
        over = socket.create_connection(("127.0.0.1", server.port))
        over.settimeout(2)
        assert over.recv(1) == b""  # closed at once, not a thread spent on it
        assert server.guard.refused >= 1
        idle[0].sendall(b"GET /v1/snapshot/5 HTTP/1.1\r\n")  # a request begun and never finished
        began = time.monotonic()
        for conn in idle:
            conn.settimeout(3)
            assert conn.recv(1) == b""  # shut at its deadline: idle 0.5 s, then the request 0.5 s
        assert time.monotonic() - began < 2.5
        manifest, tensors, report = ChunkFetcher(addresses([server]), KEY, tmp_path).fetch("snapshot")
        assert_state(tensors)
    finally:
        for conn in idle:
            conn.close()
        server.stop()
