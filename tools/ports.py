"""Free TCP ports for the servers the tests and the benchmarks start.

A port the kernel picks for ``bind(0)`` comes from the range it also gives outgoing
connections their source ports from: a client connection made between the probe and the
server's bind can hold it for as long as it lives, and a server's ports that stay fixed
across its retries (KV events endpoints) then fail every retry. No connection is given a
port below that range, so :func:`free_port` hands out ports from there, each once per
process. Standard library only: ``tests/http_server.py`` imports it too.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOWEST = 20000  # below it: ports other local services are often configured on


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _untried_ports() -> Iterator[int]:
    """Every port from ``LOWEST`` up to the ephemeral range, once each, in a random order."""
    ports = list(range(LOWEST, max(_ephemeral_low(), LOWEST + 1)))
    random.Random(os.getpid() ^ time.monotonic_ns()).shuffle(ports)
    return iter(ports)


_UNTRIED = _untried_ports()


def free_port() -> int:
    """A TCP port, free on every address a moment ago, never handed out before here.

    Two calls in a row never answer the same port (``bind(0)`` can, once the first
    probe's socket is closed).
    """
    for port in _UNTRIED:
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as ``tcp://*:port`` binds
            except OSError:
                continue
        return port
    raise RuntimeError("every TCP port below the ephemeral range was handed out")
