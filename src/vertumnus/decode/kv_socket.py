"""One GET of a hand-off's KV by a small HTTP/1.1 client of its own
(``SocketPull``), on a blocking socket in a thread (faster than the same reads
driven by the event loop, which wakes for every 64 KB the socket holds):
``recv_into`` writes the body straight into the regions of a ``KVStream``
(``kv_stream.py``), with no copy in this process. The answer must carry a
``Content-Length`` (the pool always sends one). Not here: the request (``kv_pull.py``).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time

from vertumnus.decode.kv_stream import KVStream
from vertumnus.kv_wire import HandoffError

HEAD_BYTES = 64 * 1024  # the most an answer's status line and headers may take
ERROR_BODY_BYTES = 64 * 1024  # the most of an error answer's body read


class SocketPull:
    """One GET on a blocking socket, run in a thread of its own (``recv_into``
    releases the GIL): its answer head parsed, then its body received region by
    region (``KVStream``). ``abort`` (from any thread) ends it: the blocked read
    returns and the pull fails."""

    def __init__(self, host: str, port: int, request: bytes, stream: KVStream) -> None:
        self.host, self.port, self.request, self.stream = host, port, request, stream
        self.sock: socket.socket | None = None
        self.aborted = False
        self.num_bytes = 0
        self.stream_s: float | None = None

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def run(self, timeout_s: float, context: ssl.SSLContext | None) -> tuple[int, bytes]:
        """(200, b"") once the stream is whole, or an error status and its body."""
        what = self.stream.what
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        except OSError as exc:
            message = f"{what}: cannot reach the prefill pool: {exc!r}"
            raise HandoffError(message, "unreachable") from exc
        try:
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=self.host)
            self.sock = sock
            if self.aborted:
                raise HandoffError(f"{what}: given up", "unreachable")
            sock.sendall(self.request)
            status, length, rest = self._head(sock)
            if status != 200:
                return status, self._error_body(sock, length, rest)
            first = time.perf_counter()
            body = self._body(sock, length, rest)
            self.stream_s = time.perf_counter() - first
            return status, body
        except TimeoutError as exc:
            raise HandoffError(
                f"{what}: nothing came for {timeout_s:.0f} s", "unreachable"
            ) from exc
        except OSError as exc:
            if self.aborted:
                raise HandoffError(f"{what}: given up", "unreachable") from exc
            raise HandoffError(f"{what}: the stream was truncated: {exc!r}", "truncated") from exc
        finally:
            sock.close()

    def _head(self, sock: socket.socket) -> tuple[int, int, bytes]:
        """The status, the Content-Length and the bytes read past the head."""
        what, head = self.stream.what, bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > HEAD_BYTES:
                raise HandoffError(f"{what}: an answer head too long", "malformed")
            piece = sock.recv(HEAD_BYTES)
            if not piece:
                raise HandoffError(f"{what}: the stream was truncated: no answer", "truncated")
            head += piece
        lines = head[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HandoffError(f"{what}: not an HTTP answer: {lines[0]!r}", "malformed")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            raise HandoffError(
                f"{what}: the answer has no Content-Length (a proxy between this server "
                "and the pool that re-chunks the stream?)",
                "malformed",
            )
        return int(parts[1]), int(length), bytes(head[end + 4 :])

    def _error_body(self, sock: socket.socket, length: int, rest: bytes) -> bytes:
        body = bytearray(rest)
        while len(body) < min(length, ERROR_BODY_BYTES):
            piece = sock.recv(ERROR_BODY_BYTES)
            if not piece:
                break
            body += piece
        return bytes(body[:ERROR_BODY_BYTES])

    def _body(self, sock: socket.socket, length: int, rest: bytes) -> bytes:
        what = self.stream.what
        regions = self.stream.regions()
        region: memoryview | None = next(regions)
        data = memoryview(rest)
        left = length
        while region is not None:
            if len(data):  # bytes that came with the head: copied into their regions
                n = min(len(data), len(region))
                region[:n] = data[:n]
                data = data[n:]
            else:
                if left <= 0:
                    raise HandoffError(
                        f"{what}: the stream was truncated: it ended within its Content-Length",
                        "truncated",
                    )
                n = sock.recv_into(region, min(len(region), left))
                if n == 0:
                    raise HandoffError(
                        f"{what}: the stream was truncated: {left} bytes missing", "truncated"
                    )
            left -= n
            self.num_bytes += n
            region = region[n:]
            while region is not None and not len(region):
                region = next(regions, None)
        if left != 0 or len(data):
            raise HandoffError(f"{what}: the answer's length and its stream differ", "malformed")
        return b""
