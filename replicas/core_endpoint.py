"""The engine core's clients: its owner over two pipes, and further clients (ingress processes,
cluster/ingress_replica.py) over one TCP connection each, accepted by a `CoreEndpoint`.

The core's step loop must never wait on a client. The owner's pipes are read by its own reader thread; a socket
client gets a writer thread of its own, and one that falls MAX_BACKLOG messages behind (stopped, or its host
overloaded) is dropped: its connection closes and the core aborts its requests. A connection that does not finish
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
MAX_BACKLOG = 4096              # step messages a socket client may be behind before it is dropped


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
    """A client over one duplex connection; `send` queues for the writer thread and never blocks."""

    remote = True

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.name = name
        self.closed = False
        self._queue: deque[bytes] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._writer = threading.Thread(target=self._write, name=f"tidal-core-writer-{name}", daemon=True)
        self._writer.start()

    def send(self, data: bytes) -> None:
        with self._ready:
            if self.closed:
                return
            if len(self._queue) >= MAX_BACKLOG:
                log.warning("engine client %s is %d messages behind; dropping it", self.name, len(self._queue))
                self._shut()
                return
            self._queue.append(data)
            self._ready.notify()

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self.closed:
                    self._ready.wait()
                if self.closed and not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                for data in batch:
                    self.conn.send_bytes(data)
            except OSError:
                with self._ready:
                    self._shut()
                return

    def _shut(self) -> None:
        """Under the lock: stop writing, and wake the core's wait on this connection (it reads EOF and drops us)."""
        self.closed = True
        self._queue.clear()
        self._ready.notify()
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as raw:
                raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify()
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


__all__ = ["CoreEndpoint", "HANDSHAKE_S", "MAX_BACKLOG", "PipeClient", "SocketClient", "connect"]
