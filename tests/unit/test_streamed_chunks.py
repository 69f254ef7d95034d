"""Streamed answers of the chunk server (…/fresh/<bitmap>?stream=1): one request that carries chunk after
chunk as the server has them, and the download that uses them (real servers on loopback)."""

from __future__ import annotations

import base64
import http.client
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elastic_mesh.control.kept_connections import KeptConnections
from elastic_mesh.transfer.chunk_dir import ChunkDir
from elastic_mesh.transfer.chunks import TransferError, lay_out
from elastic_mesh.transfer.fetcher import (
    FRAME_HEAD,
    Download,
    FetchReport,
    get_chunk,
    stream_chunks,
)
from elastic_mesh.transfer.server import KEY_HEADER, ChunkServer
from elastic_mesh.transfer.sources import SourcePicker
from tests.unit.test_snapshots import CHUNK, KEEP, KEY, assert_state, state


def bitmap(indices, n: int) -> str:
    bits = bytearray((n + 7) // 8)
    for i in indices:
        bits[i // 8] |= 1 << (i % 8)
    return base64.urlsafe_b64encode(bytes(bits)).decode().rstrip("=")


def sizes(manifest):
    return lambda i: manifest["chunks"][i]["size"] if 0 <= i < len(manifest["chunks"]) else None


def test_a_relay_streams_the_chunks_it_took_from_a_seeder_the_moment_it_verifies_them(tmp_path):
    """relayed=1: only the chunks the relay took from a seeder (its share of the split), each sent as it is
    verified; the stream ends when the relay completes, and the connection carries the next request."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    relay = ChunkDir(tmp_path / "relay", snapshot.manifest)
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(relay, "snapshot")
    source = f"127.0.0.1:{server.port}"
    relay.put(0, bytes(snapshot.chunk(0)), seeded=True)  # held before the request: sent at once
    put_at: dict[int, float] = {}

    def verify_more() -> None:  # the relay's own download goes on: two more from the seeder, the rest from peers
        for index in range(1, n):
            time.sleep(0.15 if index in (1, 3) else 0.01)
            put_at[index] = time.monotonic()
            relay.put(index, bytes(snapshot.chunk(index)), seeded=index in (1, 3))

    conns = KeptConnections(10)
    feeder = threading.Thread(target=verify_more)
    try:
        feeder.start()
        got = []
        for index, data, _ in stream_chunks(KEY, 10, source, f"/v1/snapshot/5/fresh/{bitmap(range(n), n)}"
                                         "?wait_ms=2000&relayed=1&stream=1", conns, sizes(snapshot.manifest)):
            got.append((index, time.monotonic()))
            assert data == bytes(snapshot.chunk(index))
        feeder.join()
        assert [i for i, _ in got] == [0, 1, 3]
        for index, when in got[1:]:
            assert when - put_at[index] < 0.5  # as it was verified, not when the relay completed
        # The stream ended cleanly: its connection went back to the pool and serves the next request.
        assert get_chunk(KEY, 10, source, "/v1/snapshot/5/chunk/2", conns).data == bytes(snapshot.chunk(2))
    finally:
        conns.close()
        server.stop()


def test_a_seeder_streams_each_requester_its_share_once(tmp_path):
    """only_new + stream: a seeder sends each chunk to one requester, at most its share (the version split
    among as many requesters as streamed the previous one), and then answers 204 (nothing new)."""
    first = lay_out(4, state(1), {"outer_step": 4}, chunk_bytes=CHUNK)
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(first, "snapshot")
    server.publish(snapshot, "snapshot")
    for requester in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):  # three streamed version 4
        server.share_of("snapshot", first, requester)
    source = f"127.0.0.1:{server.port}"
    path = f"/v1/snapshot/5/fresh/{bitmap(range(n), n)}?only_new=1&stream=1"
    conns = KeptConnections(10)
    try:
        streams = [[frame.index for frame in stream_chunks(KEY, 10, source, path, conns, sizes(snapshot.manifest))]
                   for _ in range(math.ceil(n / math.ceil(n / 3)))]
        assert all(len(s) <= math.ceil(n / 3) for s in streams) and len(streams[0]) == math.ceil(n / 3)
        assert sorted(i for s in streams for i in s) == list(range(n))  # each chunk once
        with pytest.raises(TransferError, match="none of the wanted chunks arrived"):  # 204: all sent a moment ago
            list(stream_chunks(KEY, 10, source, path, conns, sizes(snapshot.manifest)))
    finally:
        conns.close()
        server.stop()


def test_a_download_streams_from_a_seeder_and_a_peer_and_bans_a_peer_whose_frames_lie(tmp_path):
    """Download with stream: the seeder's chunks come in streamed answers, an honest peer's share over
    its standing stream; a peer whose streamed chunk does not match its hash is banned and reported, and
    the chunk comes from elsewhere."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    seeder = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    seeder.publish(snapshot, "snapshot")
    peers = []
    for name in ("honest", "liar"):
        directory = ChunkDir(tmp_path / name, snapshot.manifest)
        server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
        server.publish(directory, "snapshot")
        peers.append((directory, server))
    peers[1][1].chunk_filter = lambda kind, version, index, data: bytes(b ^ 0x55 for b in data[:64]) + bytes(data[64:])
    addresses = {name: f"127.0.0.1:{s.port}" for name, s in zip(("seeder", "honest", "liar"), (seeder, *(s for _, s in peers)))}
    empty = bytes((n + 7) // 8)

    def feed() -> None:  # both peers verify a share each as if from the seeder (this side never sees how)
        for index in range(n):
            time.sleep(0.005)
            peers[index % 2][0].put(index, bytes(snapshot.chunk(index)), seeded=True)

    target = ChunkDir(tmp_path / "me", snapshot.manifest)
    report = FetchReport(5, snapshot.manifest["total_bytes"], n)
    bad = []
    feeder = threading.Thread(target=feed)
    try:
        feeder.start()
        Download(lambda src, path, conns, first=None: get_chunk(KEY, 10, src, path, conns, first_byte_s=first), target, "snapshot",
                 lambda: {addresses["seeder"]: None, addresses["honest"]: empty, addresses["liar"]: empty},
                 SourcePicker(2), report, streams=6, stall_s=30, wait_s=2.0,
                 seeders=lambda: {addresses["seeder"]}, on_bad=lambda source, index, why, served: bad.append(source),
                 stream=lambda src, path, conns, size_of, first=None: stream_chunks(KEY, 10, src, path, conns, size_of, first)).run()
    finally:
        feeder.join()
        for s in (seeder, *(s for _, s in peers)):
            s.stop()
    assert target.complete
    assert_state(target.tensors())
    assert bad and set(bad) == {addresses["liar"]}
    assert any(addresses["liar"] in c for c in report.corrupt)
    assert addresses["liar"] not in report.bytes_from


class _Oversized(BaseHTTPRequestHandler):
    """A source that announces a frame of half a gigabyte and sends nothing of it."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        frame = FRAME_HEAD.pack(0, 1 << 29, 0)
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.write(b"%x\r\n" % len(frame) + frame + b"\r\n")
        self.wfile.flush()
        time.sleep(5)


def test_a_frame_of_the_wrong_size_ends_the_stream_before_its_bytes_are_read():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Oversized)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conns = KeptConnections(10)
    try:
        began = time.monotonic()
        with pytest.raises(TransferError, match="with 536870912 bytes, not the manifest's 65536"):
            list(stream_chunks(KEY, 10, f"127.0.0.1:{server.server_address[1]}", "/v1/x/1/fresh/AQ?stream=1",
                               conns, lambda i: 65536))
        assert time.monotonic() - began < 2.0  # not after the source's five seconds of silence
    finally:
        conns.close()
        server.shutdown()
        server.server_close()


def test_a_reader_that_stops_reading_does_not_hold_the_other_streams(tmp_path):
    """Streamed frames go out one at a time (the server's frame lock) while their bytes leave. A requester
    that stops reading (a worker starved of CPU, or one that means harm: workers are untrusted) closes its
    window; its frame must give the lock up, not hold every other stream of the server at its pace until
    the handler's 30 s timeout."""
    import socket

    from elastic_mesh.transfer.server import KEY_HEADER

    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    server = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    server.publish(snapshot, "snapshot")
    source = f"127.0.0.1:{server.port}"
    path = f"/v1/snapshot/5/fresh/{bitmap(range(n), n)}?stream=1"
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, closed after a few KiB
    stuck.bind(("127.0.0.2", 0))  # another requester: a chunk sent to one is not withheld from the other
    stuck.connect(("127.0.0.1", server.port))
    stuck.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{KEY_HEADER}: {KEY}\r\n\r\n".encode())
    time.sleep(0.3)  # its first frame is written and stops draining
    conns = KeptConnections(10)
    try:
        started = time.monotonic()
        got = [frame.index for frame in stream_chunks(KEY, 10, source, path, conns, sizes(snapshot.manifest))]
        assert sorted(got) == list(range(n))
        assert time.monotonic() - started < 5  # ~2 MB on loopback; before, each frame waited out the stuck one
    finally:
        stuck.close()
        conns.close()
        server.stop()


def test_waiting_for_a_peer_to_take_its_bytes_ends_when_the_peer_is_gone():
    """A stream holds the server's frame lock while its frame drains (`_wait_until_sent`). A peer killed with
    bytes still unsent leaves the kernel's unsent count where it was; the wait must end at the reset, not
    after give_up_s (the relay-killed e2e test: every other stream stalled past its readers' timeouts)."""
    import socket

    from elastic_mesh.transfer.server import _wait_until_sent

    listener = socket.create_server(("127.0.0.1", 0))
    receiver = socket.create_connection(listener.getsockname())
    sender, _ = listener.accept()
    sender.setblocking(False)
    try:
        while True:  # the receiver reads nothing: fill its window and the sender's buffer
            sender.send(b"x" * 65536)
    except BlockingIOError:
        pass
    sender.setblocking(True)
    started = time.monotonic()
    _wait_until_sent(sender, low_water=16 << 10, give_up_s=0.3, unsent_only=True)
    assert time.monotonic() - started >= 0.29  # alive and not reading: the wait lasts its give_up_s
    receiver.close()  # with unread bytes: the kernel answers the sender with a reset
    time.sleep(0.1)
    started = time.monotonic()
    _wait_until_sent(sender, low_water=16 << 10, give_up_s=5.0, unsent_only=True)
    assert time.monotonic() - started < 0.5
    for s in (sender, listener):
        s.close()


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "a request per chunk"])
def test_a_version_retired_during_its_download_ends_the_download_with_that_reason(tmp_path, streamed):
    """A member retires a version (newer ones arrived) while a download of it still runs: the download
    ends with that reason, its source is not marked failed, and no stream dies with a traceback (a worker
    under a slow WAN logged FileNotFoundError from its fetch threads and returned a partial version)."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    seeder = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP)
    seeder.publish(snapshot, "snapshot")
    source = f"127.0.0.1:{seeder.port}"
    target = ChunkDir(tmp_path / "me", snapshot.manifest)
    report = FetchReport(5, snapshot.manifest["total_bytes"], n)
    crashed = []
    previous_hook, threading.excepthook = threading.excepthook, lambda args: crashed.append(args.exc_value)
    try:
        with pytest.raises(TransferError, match="retired while it was fetched"):
            Download(lambda src, path, conns, first=None: get_chunk(KEY, 10, src, path, conns, first_byte_s=first), target, "snapshot",
                     lambda: {source: None}, SourcePicker(2), report, streams=2, stall_s=30,
                     on_verified=lambda index: target.remove(), seeders=lambda: {source},
                     stream=(lambda src, path, conns, size_of, first=None: stream_chunks(KEY, 10, src, path, conns, size_of, first))
                     if streamed else None).run()
    finally:
        threading.excepthook = previous_hook
        seeder.stop()
    assert not crashed and not report.failed, (crashed, report.failed)
    assert not target.directory.exists()


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "a request per chunk"])
def test_chunks_the_seeder_gave_a_leech_come_from_the_seeder_after_a_relays_time(tmp_path, streamed):
    """Issue 50's leech: the seeder counts a chunk it sent under only_new as on its way through the swarm and
    does not resend it for resend_after_s (here 60 s). A member that took every chunk and relays nothing
    used to leave the others waiting that long (0.65x the honest RL pace with 4 leeches); now a follower
    asks the seeder plainly once what it withheld has not come within a relay's time (0.5 s here)."""
    snapshot = lay_out(5, state(), {"outer_step": 5}, chunk_bytes=CHUNK)
    n = len(snapshot.manifest["chunks"])
    seeder = ChunkServer("127.0.0.1", 0, KEY, keep=KEEP, resend_after_s=60.0)
    seeder.publish(snapshot, "snapshot")
    source = f"127.0.0.1:{seeder.port}"
    # The leech asks from an address of its own (the seeder also keeps apart what it sent each address).
    leech_conn = http.client.HTTPConnection("127.0.0.1", seeder.port, timeout=10, source_address=("127.0.0.2", 0))
    try:
        for _ in range(n):  # the leech takes every chunk as new, each counted as on its way
            leech_conn.request("GET", f"/v1/snapshot/5/fresh/{bitmap(range(n), n)}?only_new=1", headers={KEY_HEADER: KEY})
            answer = leech_conn.getresponse()
            assert answer.status == 200 and answer.read()
        leech_conn.request("GET", f"/v1/snapshot/5/fresh/{bitmap(range(n), n)}?only_new=1", headers={KEY_HEADER: KEY})
        answer = leech_conn.getresponse()
        assert answer.status == 204 and not answer.read()  # every chunk is "on its way" for 60 s
        target = ChunkDir(tmp_path / "me", snapshot.manifest)
        report = FetchReport(5, snapshot.manifest["total_bytes"], n)
        leech = "127.0.0.1:1"  # a holder that holds nothing: the follower believes chunks go on through peers
        began = time.monotonic()
        Download(lambda src, path, conns, first=None: get_chunk(KEY, 10, src, path, conns, first_byte_s=first), target,
                 "snapshot", lambda: {source: None, leech: bytes((n + 7) // 8)}, SourcePicker(2), report, streams=2,
                 stall_s=30, seeders=lambda: {source},
                 stream=(lambda src, path, conns, size_of, first=None: stream_chunks(KEY, 10, src, path, conns, size_of,
                                                                                    first)) if streamed else None).run()
        took = time.monotonic() - began
    finally:
        leech_conn.close()
        seeder.stop()
    assert target.complete and report.bytes_from == {source: snapshot.manifest["total_bytes"]}
    assert took < 10, f"{took:.1f} s: the follower waited on the seeder's only_new pause"
