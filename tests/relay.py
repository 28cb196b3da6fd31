"""Shared by the tests that put a TCP relay between one replica and a port it
connects to: to copy, alter, cut or count what passes. It knows TCP only, not
ZMTP or zcollective's messages; the tests that use it add those by overriding
:meth:`Relay.pump` and :meth:`Relay.connected`.

Every wait is bounded and every thread is a daemon, so a relay never hangs a
test; :meth:`Relay.stop` closes every socket it opened.
"""

import contextlib
import select
import socket
import threading
from typing import Callable, Optional, TypeVar

POLL_S = 0.1  # how soon a pump notices stop(), or an idle line, when nothing arrives
CONNECT_S = 5.0  # the upstream port is on loopback: it answers at once, or is not up yet
SEND_S = 10.0  # a peer that reads nothing for this long is gone, even on a loaded machine
JOIN_S = 5.0  # a pump leaves within POLL_S of stop(), or at once once its sockets are shut
CHUNK = 65536

Pump = Callable[[Optional[bytes]], bytes]
R = TypeVar("R", bound="Relay")


class Relay:
    """Listens on 127.0.0.1 (at :attr:`port`); connects each accepted
    connection to ``upstream`` on 127.0.0.1 and carries the bytes both ways,
    each direction through the function :meth:`pump` makes for it. When
    either side closes, the relay closes both.

    A subclass sets its own attributes before calling ``__init__``: the
    relay accepts from then on.

    Parameters
    ----------
    upstream : int
        The port on 127.0.0.1 that each connection is relayed to. While it is
        not up, a connection is closed at once (its client will connect again).
    poll_s : float
        How long a pump waits for bytes before calling its function with
        ``None`` (an idle line) and checking whether the relay is stopping.

    Raises
    ------
    OSError
        No port to listen on.
    """

    def __init__(self, upstream: int, *, poll_s: float = POLL_S):
        self.upstream, self.poll_s = upstream, poll_s
        self.connections = 0  # relayed so far (those that reached upstream)
        self.stopping = threading.Event()
        self._sockets: list[socket.socket] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(poll_s)
        self.port: int = self.server.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._threads: list[threading.Thread] = []
        self._acceptor.start()

    # -- hooks ---------------------------------------------------------------------------

    def pump(self, upward: bool) -> Pump:
        """A function that carries one direction of one connection.

        It is given each chunk read (``None`` when nothing came for
        ``poll_s``) and returns the bytes to send on. It is made anew for
        each connection and direction, so it may keep state of its own.

        Parameters
        ----------
        upward : bool
            True for the client's bytes towards ``upstream``.
        """
        return lambda data: data or b""

    def connected(self, client: socket.socket, upstream: socket.socket) -> None:
        """Called once per relayed connection (after :attr:`connections`
        counts it), before any byte of it is carried."""

    def spawn(self, target: Callable[..., object], *args: object) -> None:
        """Run ``target(*args)`` in a daemon thread that :meth:`stop` waits for."""
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- driver --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=CONNECT_S)
            except OSError:  # not up yet: the client will connect again
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(SEND_S)  # reads wait in select(); this bounds sendall()
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go at once
            self._sockets += (client, upstream)
            self.connections += 1
            self.connected(client, upstream)
            self.spawn(self._carry, client, upstream, self.pump(True))
            self.spawn(self._carry, upstream, client, self.pump(False))

    def _carry(self, src: socket.socket, dst: socket.socket, pump: Pump) -> None:
        try:
            while not self.stopping.is_set():
                readable, _, _ = select.select([src], [], [], self.poll_s)
                data = src.recv(CHUNK) if readable else None
                if data == b"":
                    break
                out = pump(data)
                if out:
                    dst.sendall(out)
        except (OSError, ValueError):  # ValueError: src closed by stop() after JOIN_S
            pass
        _shut(src, dst)  # the other direction sees the end at once
        src.close()  # each socket is one pump's src: that pump closes it

    def stop(self) -> None:
        """Stop accepting and carrying, wait (bounded) for the threads, close
        every socket. Safe to call more than once."""
        self.stopping.set()
        self._acceptor.join(JOIN_S + CONNECT_S)  # no new thread or socket after this
        _shut(*self._sockets)  # wakes a pump blocked in sendall()
        for thread in self._threads:
            thread.join(JOIN_S)
        for s in (self.server, *self._sockets):
            s.close()

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _shut(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
