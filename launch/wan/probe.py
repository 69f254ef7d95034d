"""Measures an emulated link from inside a namespace: RTT, TCP throughput, UDP loss.

    python launch/wan/probe.py serve PORT                 # echo / sink / UDP counter (runs until killed)
    python launch/wan/probe.py rtt HOST PORT [N]          # median round trip of N small TCP messages, ms
    python launch/wan/probe.py throughput HOST PORT MB    # one TCP stream, Mbit/s of payload
    python launch/wan/probe.py loss HOST PORT N           # fraction of N UDP datagrams that got through
Prints one JSON object.
"""

from __future__ import annotations

import json
import socket
import socketserver
import statistics
import sys
import threading
import time


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = self.request.recv(1)
        if mode == b"E":  # echo 64-byte messages
            while data := self.request.recv(64):
                self.request.sendall(data)
        elif mode == b"S":  # sink, then report the byte count
            total = 0
            while data := self.request.recv(1 << 16):
                if data.endswith(b"#END#"):
                    total += len(data) - 5
                    break
                total += len(data)
            self.request.sendall(str(total).encode())


def serve(port: int) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", port))
    counts: dict = {}

    def count_udp():
        while True:
            data, peer = udp.recvfrom(2048)
            if data.startswith(b"Q"):  # a query for how many arrived
                udp.sendto(str(counts.get(peer[0], 0)).encode(), peer)
            else:
                counts[peer[0]] = counts.get(peer[0], 0) + 1
    threading.Thread(target=count_udp, daemon=True).start()
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer(("0.0.0.0", port), _Handler) as server:
        print(json.dumps({"serving": port}), flush=True)
        server.serve_forever()


def rtt(host: str, port: int, n: int = 20) -> dict:
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"E")
        times = []
        for _ in range(n):
            t = time.perf_counter()
            s.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64 - got))
            times.append((time.perf_counter() - t) * 1e3)
    return {"rtt_ms": statistics.median(times), "min_ms": min(times)}


def throughput(host: str, port: int, mb: float) -> dict:
    payload = b"\0" * (1 << 16)
    total = int(mb * 1e6)
    with socket.create_connection((host, port), timeout=120) as s:
        s.sendall(b"S")
        started = time.perf_counter()
        sent = 0
        while sent < total:
            chunk = payload[: min(len(payload), total - sent)]
            s.sendall(chunk)
            sent += len(chunk)
        s.sendall(b"#END#")
        received = int(s.recv(64))
        elapsed = time.perf_counter() - started
    return {"mbit_s": received * 8 / elapsed / 1e6, "bytes": received, "seconds": elapsed}


def loss(host: str, port: int, n: int) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(n):
        s.sendto(b"D" * 200, (host, port))
        time.sleep(0.001)  # stay far below the link rate: measure loss, not queue overflow
    time.sleep(1.0)
    # The query and its answer cross the same lossy links: ask until one answer gets through (queries
    # are not counted as data, so asking again changes nothing).
    s.settimeout(1.0)
    for _ in range(30):
        s.sendto(b"Q", (host, port))
        try:
            arrived = int(s.recvfrom(64)[0])
            break
        except TimeoutError:
            continue
    else:
        raise TimeoutError(f"no answer to 30 queries from {host}:{port}; is the link up?")
    return {"sent": n, "arrived": arrived, "loss": 1 - arrived / n}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "serve":
        serve(int(args[0]))
    else:
        fn = {"rtt": rtt, "throughput": throughput, "loss": loss}[cmd]
        print(json.dumps(fn(args[0], int(args[1]), *(float(a) if "." in a else int(a) for a in args[2:]))))
