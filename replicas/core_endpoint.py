"""The engine core's clients: its owner over two pipes, and further clients (ingress processes,
cluster/ingress_replica.py) over one TCP connection each, accepted by a `CoreEndpoint`.

The core's step loop must never wait on a client. The owner's pipes are read by its own reader thread; a socket
client is written without blocking, and one that falls MAX_PENDING_BYTES behind (stopped, or its host overloaded)
is dropped: its connection closes and the core aborts its requests. A connection that does not finish
the authentication handshake within HANDSHAKE_S is closed without reaching the step loop.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections import deque
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from replicas.engine_messages import CoreAddress

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0
MAX_PENDING_BYTES = 64 << 20     # what a socket client may be behind before it is dropped


class PipeClient:
    """The owner: it reads `inputs` from the process that started the core, and takes what `send` writes."""

    remote = False

    def __init__(self, inputs: Connection, outputs: Connection):
        self.conn, self.outputs = inputs, outputs

    def send(self, data: bytes) -> None:
        self.outputs.send_bytes(data)

    def close(self) -> None:
        self.outputs.close()


class SocketClient:
    """A client over one duplex connection. `send` writes from the step loop without blocking (MSG_DONTWAIT, in
    multiprocessing.connection's framing, so the client reads with `recv_bytes`); what the socket does not take
    waits in `pending` and goes out with later sends or `flush()`. A thread per client would cost the step loop
    more: each write's return competes for the core's GIL. A client whose pending bytes pass MAX_PENDING_BYTES
    (stopped, or its host overloaded) is `closed`; the core then drops it."""

    remote = True

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self.closed = False
        self.pending = bytearray()
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))      # for send flags; reads stay on `conn`

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        self.pending += struct.pack("!i", len(data))
        self.pending += data
        self.flush()

    def flush(self) -> None:
        if not self.pending or self.closed:
            return
        try:
            sent = self._sock.send(self.pending, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._shut()
            return
        del self.pending[:sent]
        if len(self.pending) > MAX_PENDING_BYTES:
            log.warning("engine client %s is %d bytes behind; dropping it", self.name, len(self.pending))
            self._shut()

    def _shut(self) -> None:
        """Stop writing, and wake the core's wait on this connection (it reads EOF and drops us)."""
        self.closed = True
        self.pending.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.closed = True
        self.pending.clear()
        self._sock.close()
        self.conn.close()


class CoreEndpoint:
    """Accepts authenticated clients on a TCP port. The step loop waits on `fileno()` beside its clients'
    connections; when it is readable, `take()` hands over the clients that connected."""

    def __init__(self, host: str):
        self.authkey = os.urandom(32)
        self._server = socket.create_server((host, 0))
        self.address = CoreAddress(host, self._server.getsockname()[1], self.authkey)
        self._pending: deque[Connection] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._count = 0
        threading.Thread(target=self._accept, name="tidal-core-endpoint", daemon=True).start()

    def fileno(self) -> int:
        return self._wake_r

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return                          # closed
            threading.Thread(target=self._handshake, args=(sock, peer), daemon=True).start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        timeout = struct.pack("ll", int(HANDSHAKE_S), 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except (AuthenticationError, OSError, EOFError) as e:
            log.warning("engine core: a client from %s failed to authenticate (%s)", peer, e)
            conn.close()
            return
        untimed = struct.pack("ll", 0, 0)
        with socket.socket(fileno=os.dup(conn.fileno())) as raw:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, untimed)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, untimed)
        with self._lock:
            self._pending.append(conn)
        os.write(self._wake_w, b"\0")

    def take(self) -> list[SocketClient]:
        os.read(self._wake_r, 4096)
        with self._lock:
            conns = list(self._pending)
            self._pending.clear()
        clients = []
        for conn in conns:
            self._count += 1
            clients.append(SocketClient(conn, f"{self.address.port}-{self._count}"))
        return clients

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()


def connect(address: CoreAddress, timeout_s: float = HANDSHAKE_S) -> Connection:
    """A client's end: a connection to the core at `address`, authenticated both ways."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, address.authkey)
        deliver_challenge(conn, address.authkey)
    except BaseException:
        conn.close()
        raise
    return conn


__all__ = ["CoreEndpoint", "HANDSHAKE_S", "MAX_PENDING_BYTES", "PipeClient", "SocketClient", "connect"]
