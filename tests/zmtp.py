"""Shared by the tests that speak ZMTP 3 over a raw TCP socket, as a stranger
would: what ZeroMQ writes on the wire, built and parsed by hand."""

import socket
import time

GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04  # frame flags


def greeting(mechanism=b"NULL"):
    """A ZMTP 3.0 client's greeting: signature, version, mechanism, as-server 0."""
    return b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


def command(name, body=b""):
    data = bytes([len(name)]) + name + body
    if len(data) < 256:
        return bytes([COMMAND, len(data)]) + data
    return bytes([COMMAND | LONG]) + len(data).to_bytes(8, "big") + data


def ready(socket_type):
    """The NULL mechanism's READY command, for a socket of ``socket_type`` (b"PUSH")."""
    return command(b"READY", b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type)


def message(frames):
    """A message as ZMTP 3 frames on the wire."""
    out = bytearray()
    for i, frame in enumerate(frames):
        more = MORE if i < len(frames) - 1 else 0
        if len(frame) > 255:
            out += bytes([more | LONG]) + len(frame).to_bytes(8, "big")
        else:
            out += bytes([more, len(frame)])
        out += frame
    return bytes(out)


def next_frame(buf):
    """(flags, body, length on the wire) of the first whole frame in ``buf``, or None."""
    if len(buf) < 2:
        return None
    flags = buf[0]
    if flags & LONG:
        if len(buf) < 9:
            return None
        size, start = int.from_bytes(buf[1:9], "big"), 9
    else:
        size, start = buf[1], 2
    if len(buf) < start + size:
        return None
    return flags, bytes(buf[start:start + size]), start + size


def server_answer(sock, timeout):
    """Read a server's greeting and its first command: (mechanism, command
    name), the name None if it closed the connection or said nothing more
    within ``timeout`` seconds."""
    buf, deadline = bytearray(), time.monotonic() + timeout
    while True:
        parsed = next_frame(buf[GREETING_BYTES:]) if len(buf) >= GREETING_BYTES else None
        if parsed is not None:
            name = parsed[1][1:1 + parsed[1][0]] if parsed[0] & COMMAND else None
            return bytes(buf[12:32]).rstrip(b"\0"), name
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except (TimeoutError, ConnectionError):
            break
        if not data:
            break
        buf += data
    mechanism = bytes(buf[12:32]).rstrip(b"\0") if len(buf) >= 32 else None
    return mechanism, None


def connect(endpoint, timeout):
    """A TCP connection to ``tcp://host:port``."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
