"""Hosts for tests and benchmarks on one machine: network namespaces joined by
a bridge, each with its own address and no loopback path to the others, each
link optionally shaped to a rate in both directions, each link able to be cut.

::

    from netns import Hosts            # tests/ is on sys.path in tests; benchmarks add it

    with Hosts(3, rate_mbit=200) as hosts:
        hosts.addresses[0]             # "198.18.x.1": host 0's address
        hosts.prefix(1)                # ["ip", "netns", "exec", NS]: run a command on host 1
        hosts.run(1, "ping", "-c1", hosts.addresses[0])
        hosts.cut(2)                   # host 2's cable pulled; hosts.restore(2) plugs it back

Layout: a "switch" namespace holding a bridge, and per host a namespace whose
interface ``LINK`` (the same name on every host, so ``GLOO_SOCKET_IFNAME`` and
MPI's interface options can name it) is one end of a veth pair; the other end
is a port of the bridge. Both ends are created inside their namespaces, so no
interface name ever exists in the caller's namespace and concurrent users
cannot collide; namespace names carry a prefix and the process id.

Shaping (``rate_mbit``): a token bucket filter (``tc ... tbf``) on the egress
of both ends of each host's veth. The host end shapes what the host sends, the
bridge port what it receives: a full-duplex link of that rate per host, as a
switch port would be.

Needs root, iproute2 (``ip``) and, for shaping, ``tc``; :func:`unavailable`
says why not. Every namespace is deleted on exit, also on failure or Ctrl-C
inside the ``with`` block. Processes started in a namespace must be ended by
whoever started them: deleting a namespace does not end its processes. This
module knows nothing of zcollective.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Optional, Sequence

SUBNET = "198.18.{}"  # RFC 2544 benchmarking range: never routed, never anybody's address
LINK = "eth0"  # every host's interface: the name tools expect of a host's one network card
IP_TIMEOUT_S = 20.0  # one ip/tc command; they take milliseconds unless the machine is stuck
BURST_BYTES = 256 << 10  # above the 64 KiB GSO packets veth passes, so tbf never splits them
LATENCY_MS = 50  # queue bound: deep enough that TCP never starves the link, still a real queue


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be built on this machine (not root, no iproute2, a
    kernel or container that refuses); the message says which."""


def unavailable(shaping: bool = False) -> Optional[str]:
    """Why :class:`Hosts` cannot run here, or None if it can (as far as can be
    told without trying)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if shaping and shutil.which("tc") is None:
        return "iproute2's `tc` is not installed (needed to shape links)"
    return None


def _run(cmd: Sequence[str], ns: Optional[str] = None) -> None:
    full = list(cmd) if ns is None else ["ip", "netns", "exec", ns, *cmd]
    subprocess.run(full, check=True, capture_output=True, timeout=IP_TIMEOUT_S)


class Hosts:
    """``n`` hosts as network namespaces on one bridge; a context manager.

    Parameters
    ----------
    n
        Number of hosts (at most 253: one /24).
    rate_mbit
        Shape every host's link to this rate (Mbit/s) in both directions;
        ``None``: unshaped (veth speed, bounded by the CPU).
    prefix
        Start of the namespace names (``<prefix><pid>-h<i>``, ``...-sw``), so
        a leftover is recognizable.
    burst_bytes, latency_ms
        The token bucket's burst and queue bound (see the module constants).

    Attributes
    ----------
    names
        Each host's namespace name.
    addresses
        Each host's IPv4 address on the bridge.
    link
        The interface name on every host (:data:`LINK`).

    Raises
    ------
    NetnsUnavailable
        On entry, when the namespaces or the shaping cannot be built here;
        whatever was built is removed first.
    """

    def __init__(self, n: int, rate_mbit: Optional[float] = None, *, prefix: str = "zc",
                 burst_bytes: int = BURST_BYTES, latency_ms: float = LATENCY_MS) -> None:
        if not 1 <= n <= 253:
            raise ValueError(f"n must be between 1 and 253 hosts, not {n}")
        self.n = n
        self.rate_mbit = rate_mbit
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        pid = os.getpid()
        tag = f"{prefix}{pid}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        subnet = SUBNET.format(pid % 250)  # each set has its own bridge: a shared subnet would do too
        self.addresses = [f"{subnet}.{i + 1}" for i in range(n)]
        self.link = LINK
        self._made: list[str] = []

    # -- building and removing ------------------------------------------------

    def __enter__(self) -> Hosts:
        why = unavailable(shaping=self.rate_mbit is not None)
        if why:
            raise NetnsUnavailable(why)
        try:
            self._build()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            self.close()
            stderr = getattr(exc, "stderr", b"") or b""
            raise NetnsUnavailable(f"cannot build network namespaces here: {exc.cmd}: "
                                   f"{stderr.decode(errors='replace').strip()}") from exc
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in (self.switch, *self.names):
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            _run(["ip", "link", "set", "lo", "up"], ns=ns)  # local daemons (MPI's) talk over it
        _run(["ip", "link", "add", "br0", "type", "bridge"], ns=self.switch)
        _run(["ip", "link", "set", "br0", "up"], ns=self.switch)
        for i, ns in enumerate(self.names):
            port = self._port(i)
            _run(["ip", "link", "add", LINK, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", self.switch])
            _run(["ip", "link", "set", port, "master", "br0"], ns=self.switch)
            _run(["ip", "link", "set", port, "up"], ns=self.switch)
            _run(["ip", "addr", "add", f"{self.addresses[i]}/24", "dev", LINK], ns=ns)
            _run(["ip", "link", "set", LINK, "up"], ns=ns)
            if self.rate_mbit is not None:
                self.shape(i, self.rate_mbit)

    def close(self) -> None:
        """Delete every namespace built (idempotent; never raises)."""
        while self._made:
            ns = self._made.pop()
            try:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=IP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass  # nothing better to do while cleaning up; the name says whose it was

    # -- using the hosts ------------------------------------------------------

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.names[host]]

    def run(self, host: int, *cmd: str, timeout: float = IP_TIMEOUT_S,
            **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        """Run ``cmd`` on ``host`` to completion (``check=True``, output
        captured, unless ``kwargs`` say otherwise).

        Raises
        ------
        subprocess.CalledProcessError, subprocess.TimeoutExpired
            As :func:`subprocess.run`.
        """
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("check", True)
        return subprocess.run([*self.prefix(host), *cmd], timeout=timeout, **kwargs)

    def popen(self, host: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start ``cmd`` on ``host``; the caller ends it."""
        return subprocess.Popen([*self.prefix(host), *cmd], **kwargs)

    def cut(self, host: int) -> None:
        """Take ``host``'s link down, as a pulled cable: its packets go nowhere
        and nothing reaches it, with no reset sent to anyone."""
        _run(["ip", "link", "set", LINK, "down"], ns=self.names[host])

    def restore(self, host: int) -> None:
        """Bring ``host``'s link back up after :meth:`cut` (shaping survives)."""
        _run(["ip", "link", "set", LINK, "up"], ns=self.names[host])

    def shape(self, host: int, rate_mbit: Optional[float]) -> None:
        """Shape ``host``'s link to ``rate_mbit`` in both directions, replacing
        any shaping; ``None`` removes it."""
        ends = ((LINK, self.names[host]), (self._port(host), self.switch))
        for dev, ns in ends:
            if rate_mbit is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=IP_TIMEOUT_S)  # absent already: fine
                continue
            _run(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                  "burst", str(self.burst_bytes), "latency", f"{self.latency_ms}ms"], ns=ns)

    @staticmethod
    def _port(host: int) -> str:
        return f"p{host}"
