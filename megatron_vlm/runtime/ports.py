"""Choosing a free TCP port for a local rendezvous (torchrun's static rendezvous, spawned worlds).

``bind(port 0)`` lets the kernel pick a port from its ephemeral range (``net.ipv4.ip_local_port_range``), and the
socket is closed before torchrun or gloo binds it. The kernel hands out the same range to every outgoing
connection (gloo opens one per peer), so on a busy host another process's connection can take the port in between
(EADDRINUSE at rendezvous; seen with two test workers). A port drawn at random BELOW that range, and checked free
by binding it, is taken only by another explicit choice. Where no such range exists, the kernel's pick is used.
"""

from __future__ import annotations

import random
import socket

LOWEST = 20000  # below: well-known service ports people configure by hand
_ATTEMPTS = 50


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux), else the IANA one."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now, outside the kernel's ephemeral range where possible (see the module
    docstring)."""
    low, _ = ephemeral_range()
    pick = random.SystemRandom()  # independent of any seeded random state
    if low - LOWEST > 1000:
        for _ in range(_ATTEMPTS):
            port = pick.randrange(LOWEST, low)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
