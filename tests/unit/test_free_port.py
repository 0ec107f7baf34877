"""`free_port` draws from below the kernel's ephemeral range, where no client socket can take
the port before the caller binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from omniloop.processes import free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_the_port_is_below_the_ephemeral_range_and_bindable() -> None:
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < _ephemeral_low() for port in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_seeded_random_module_does_not_fix_the_draw() -> None:
    random.seed(0)
    first = free_port()
    random.seed(0)
    second = free_port()
    random.seed(0)
    third = free_port()
    assert len({first, second, third}) > 1
