"""The Redis the whole test session uses, chosen once before any test module is imported.

The configured address is `DISAGG_TEST_REDIS_URL`, else `REDIS_URL` (the variable the demo
reads), else the shared server at 127.0.0.1:6379. When it answers PING the tests use it, as
they always did. When nothing answers there, the session starts a private `redis-server`
(tests/redis_server.py: its own loopback port and temporary directory, nothing on disk) and
says so in one line; without the binary it stops before the first test with one line saying
how to get one, instead of failing test after test on a refused connection.
"""

from __future__ import annotations

import enum
import shutil
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis

from state import redact_url
from tests.redis_server import PrivateRedis

__all__ = [
    "DEFAULT_URL",
    "URL_VARIABLES",
    "Configured",
    "Plan",
    "SessionRedis",
    "answers",
    "configured",
    "plan",
    "port_of",
]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
# Most specific first: a variable for the tests alone, then the one the demo shares.
URL_VARIABLES = ("DISAGG_TEST_REDIS_URL", "REDIS_URL")
PING_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Configured:
    """Where the tests were told to find Redis, and which variable said so (None: default)."""

    url: str
    variable: str | None

    def __str__(self) -> str:
        where = redact_url(self.url)
        return f"{where} ({self.variable})" if self.variable else where


def configured(environ: Mapping[str, str]) -> Configured:
    for name in URL_VARIABLES:
        if environ.get(name):
            return Configured(environ[name], name)
    return Configured(DEFAULT_URL, None)


def answers(url: str) -> bool:
    """PING through the client the tests use, so a password, a database or TLS in the URL
    count as they will for the tests; a URL it cannot read counts as nothing answering."""
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=PING_TIMEOUT_S, socket_timeout=PING_TIMEOUT_S
        )
    except ValueError:
        return False
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class Plan(enum.Enum):
    USE_CONFIGURED = "use the configured Redis"
    START_PRIVATE = "start a private redis-server"
    STOP = "stop the session"


def plan(*, configured_answers: bool, redis_server_binary: str | None) -> Plan:
    if configured_answers:
        return Plan.USE_CONFIGURED
    if redis_server_binary is not None:
        return Plan.START_PRIVATE
    return Plan.STOP


def port_of(url: str) -> int:
    """The TCP port a redis:// URL names (6379 when it names none)."""
    return urlsplit(url).port or 6379


class SessionRedis:
    """The decision made and carried out: `url` is what every test and child process uses."""

    def __init__(self, environ: MutableMapping[str, str]) -> None:
        self._environ = environ
        self.configured = configured(environ)
        self.url = self.configured.url
        self.private: PrivateRedis | None = None
        self._saved: dict[str, str | None] = {}

    def start(self) -> Plan:
        """Plan.STOP leaves everything as it was: the caller ends the session with
        `stop_line`. Plan.START_PRIVATE has a server running and the variables exported."""
        chosen = plan(
            configured_answers=answers(self.configured.url),
            redis_server_binary=shutil.which("redis-server"),
        )
        if chosen is Plan.START_PRIVATE:
            server = PrivateRedis()
            server.start()
            self.private, self.url = server, server.url
            # Child processes (a router, a tool, a nested pytest) read the variables, not this
            # object; REDIS_URL is replaced only when it was set (an unset one means "the demo
            # starts its own", which the demo's tests rely on).
            self._export("DISAGG_TEST_REDIS_URL")
            if self._environ.get("REDIS_URL"):
                self._export("REDIS_URL")
        return chosen

    def _export(self, name: str) -> None:
        self._saved[name] = self._environ.get(name)
        self._environ[name] = self.url

    def stop(self) -> None:
        """The private server killed and the variables put back; safe to call twice."""
        if self.private is not None:
            self.private.kill()
            self.private = None
        for name, value in self._saved.items():
            if value is None:
                self._environ.pop(name, None)
            else:
                self._environ[name] = value
        self._saved.clear()

    def private_line(self) -> str:
        return (
            f"redis: nothing answers at {self.configured}; this session uses a private "
            f"redis-server at {self.url}, stopped at the end"
        )

    def stop_line(self) -> str:
        return (
            f"no Redis answers at {self.configured} and no redis-server is on PATH: install "
            "one (apt-get install redis-server, brew install redis) or set "
            "DISAGG_TEST_REDIS_URL to a Redis that answers"
        )
