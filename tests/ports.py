"""Free loopback ports for servers the tests start (workers, routers, private Redis servers).

Its own module so that tests/redis_server.py, which the session start-up in tests/conftest.py
uses, can pick a port without importing the conftest it is imported by.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]


# Ports handed out by this process: a server binds its port only once it has started (an engine
# after tens of seconds), so a port given twice would be free to both at the check and taken
# by one at the bind. Cleared when it holds half the range.
_GIVEN: set[int] = set()


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (32768+ by default), for a
    server started later: vLLM binds some of its own ZMQ sockets to port 0, and a port we
    picked there could be handed to another engine before ours binds it ("Address already
    in use", and that engine never starts). Never one this process handed out already."""
    rng = random.Random()
    if len(_GIVEN) > 6000:
        _GIVEN.clear()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free port in 20000-31999")
