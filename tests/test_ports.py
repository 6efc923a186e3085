"""megatron_vlm.runtime.ports: rendezvous ports are drawn below the kernel's ephemeral range, so that a port the kernel
hands to some process's outgoing connection (gloo opens one per peer) cannot take it between the choice and
torchrun's bind (EADDRINUSE seen with two pytest workers on one host)."""

import socket

import pytest

from megatron_vlm.runtime import ports

pytestmark = pytest.mark.one_lane("3.11", reason="rendezvous ports against the kernel's ephemeral range: the standard "
                                                 "library")


def test_ports_are_free_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert low < high
    chosen = {ports.free_port() for _ in range(20)}
    assert len(chosen) > 1  # drawn at random, not the kernel's next port
    for port in chosen:
        assert ports.LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free


def test_a_taken_port_is_never_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 1, 65535))
        monkeypatch.setattr(ports, "LOWEST", taken - 1000 if taken > 1100 else 1024)
        seen = {ports.free_port() for _ in range(200)}
        assert taken not in seen
