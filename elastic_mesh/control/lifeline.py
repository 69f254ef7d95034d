"""A node's lifeline: one idle TCP connection to the coordinator that lives exactly as long as the process.

When a process dies (SIGKILL, a crash, the OOM killer), its kernel closes its connections at once, and
the coordinator's end of the lifeline reads the close: the node is gone now, not when its lease runs out.
A machine or a link that goes silent closes nothing; that case is still the lease's. The connection
carries nothing after its opening request, so it costs one socket and one thread per node on each side.

The node re-opens it whenever it breaks (a coordinator restart), and stops it only after it has said
it leaves, so a clean exit never reads as a death.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading

log = logging.getLogger(__name__)

PATH = "/v1/lifeline"
REPLACED = b"replaced\n"  # the one thing the coordinator ever sends on it: a newer lifeline took its place


class LifeLine:
    def __init__(self, address: str, node_id: str, session: str, connect_timeout_s: float = 10.0,
                 tls: ssl.SSLContext | None = None) -> None:
        """tls: the client context of a coordinator that speaks TLS (CoordinatorClient.tls)."""
        self.address, self.node_id, self.session, self.tls = address, node_id, session, tls
        self.connect_timeout_s = connect_timeout_s
        self.refused: str | None = None  # why the coordinator refused it (then it is not re-opened)
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lifeline")

    def start(self) -> "LifeLine":
        self._thread.start()
        return self

    def _open(self) -> socket.socket:
        host, port = self.address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout_s)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock)
            except OSError:
                sock.close()
                raise
        request = (f"POST {PATH} HTTP/1.1\r\nHost: {self.address}\r\nContent-Length: 0\r\n"
                   f"X-Prime-Node: {self.node_id}\r\nX-Prime-Session: {self.session}\r\n\r\n")
        sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            data = sock.recv(4096)
            if not data:
                raise ConnectionError("the coordinator closed the lifeline before answering")
            head += data
        status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/") else b"?"
        if status != b"200":
            headers, body = head.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":", 1)[1]) for line in headers.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < min(length, 4096) and (data := sock.recv(4096)):
                body += data
            sock.close()
            raise PermissionError(body[:300].decode(errors="replace") or f"HTTP {status.decode()}")
        sock.settimeout(None)  # from now on it only waits for the coordinator's end to close
        return sock

    def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            try:
                sock = self._open()
            except PermissionError as e:
                self.refused = str(e)
                log.warning("the coordinator refused this node's lifeline: %s", e)
                return
            except OSError:
                self._stop.wait(delay)  # the coordinator is restarting or unreachable: the lease covers it
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.2
            with self._lock:
                if self._stop.is_set():
                    sock.close()
                    return
                self._sock = sock
            received = b""
            try:
                while data := sock.recv(4096):  # b"": the coordinator's end closed (a restart: re-open)
                    received += data[:64]
            except OSError:
                pass
            with self._lock:
                self._sock = None
            sock.close()
            if received.startswith(REPLACED):
                self.refused = "replaced by a newer lifeline of this node"
                return

    def stop(self) -> None:
        """Closes it; call only after the node told the coordinator it leaves (else this reads as a death)."""
        with self._lock:
            self._stop.set()
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
