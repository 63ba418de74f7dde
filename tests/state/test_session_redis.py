"""The session's Redis (tests/session_redis.py): the decision, and the whole path in a child
pytest whose configured Redis does not answer — with redis-server on PATH (a private server,
one line, the test gets a working Redis, nothing left running) and without it (one line, a
non-zero exit, no test run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL
from tests.paths import REPO
from tests.ports import free_port
from tests.session_redis import DEFAULT_URL, Configured, Plan, answers, configured, plan

REPO = REPO
CHILD_TIMEOUT_S = 60.0

# The child's one test: it records the URL it was given, after checking that Redis answers
# there and that processes it would start are told the same URL.
TINY_TEST = """
import os
from pathlib import Path

import redis

from tests.conftest import REDIS_URL


def test_the_session_redis_works() -> None:
    assert os.environ["DISAGG_TEST_REDIS_URL"] == REDIS_URL
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.set("session-redis-check", "yes")
        assert client.get("session-redis-check") == b"yes"
    finally:
        client.close()
    Path(os.environ["SESSION_REDIS_OUT"]).write_text(REDIS_URL)
"""


@pytest.mark.parametrize(
    ("configured_answers", "binary", "expected"),
    [
        (True, "/usr/bin/redis-server", Plan.USE_CONFIGURED),
        (True, None, Plan.USE_CONFIGURED),
        (False, "/usr/bin/redis-server", Plan.START_PRIVATE),
        (False, None, Plan.STOP),
    ],
)
def test_the_plan(configured_answers: bool, binary: str | None, expected: Plan) -> None:
    assert plan(configured_answers=configured_answers, redis_server_binary=binary) is expected


def test_the_configured_address_most_specific_first() -> None:
    tests_url, demo_url = "redis://127.0.0.1:7001/0", "redis://127.0.0.1:7002/0"
    both = {"DISAGG_TEST_REDIS_URL": tests_url, "REDIS_URL": demo_url}
    assert configured(both) == Configured(tests_url, "DISAGG_TEST_REDIS_URL")
    assert configured({"REDIS_URL": demo_url}) == Configured(demo_url, "REDIS_URL")
    assert configured({"REDIS_URL": ""}) == Configured(DEFAULT_URL, None)
    assert configured({}) == Configured(DEFAULT_URL, None)


def test_answers_tells_a_live_redis_from_a_dead_port() -> None:
    assert answers(REDIS_URL)
    assert not answers(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert not answers("http://127.0.0.1:1")  # not a Redis URL at all


def _child_pytest(tmp_path: Path, dead_url: str, path: str) -> subprocess.CompletedProcess[str]:
    """pytest on TINY_TEST alone, with this suite's conftest as a plugin and the configured
    Redis at `dead_url`; its own ini, so the repository's options do not apply."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_default_fixture_loop_scope = function\n"
    )
    (tmp_path / "test_tiny.py").write_text(TINY_TEST)
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env |= {
        "DISAGG_TEST_REDIS_URL": dead_url,
        "SESSION_REDIS_OUT": str(tmp_path / "url"),
        "PATH": path,
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    argv += ["-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_tiny.py")]
    return subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
    )


def test_a_session_without_redis_starts_a_private_one(tmp_path: Path) -> None:
    dead_url = f"redis://127.0.0.1:{free_port()}/0"
    done = _child_pytest(tmp_path, dead_url, os.environ["PATH"])
    assert done.returncode == 0, done.stdout + done.stderr
    used = (tmp_path / "url").read_text()
    assert used != dead_url
    line = (
        f"redis: nothing answers at {dead_url} (DISAGG_TEST_REDIS_URL); this session uses a "
        f"private redis-server at {used}, stopped at the end"
    )
    assert line in done.stdout.splitlines(), done.stdout
    assert "1 passed" in done.stdout
    assert not answers(used)  # killed when the child session ended


def test_a_session_without_redis_or_the_binary_stops_at_once(tmp_path: Path) -> None:
    dead_url = f"redis://127.0.0.1:{free_port()}/0"
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    done = _child_pytest(tmp_path, dead_url, str(empty_bin))
    assert done.returncode == 4, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"Exit: no Redis answers at {dead_url} (DISAGG_TEST_REDIS_URL) and no redis-server is "
        "on PATH: install one (apt-get install redis-server, brew install redis) or set "
        "DISAGG_TEST_REDIS_URL to a Redis that answers"
    ]
    assert "passed" not in done.stdout and "failed" not in done.stdout
    assert not (tmp_path / "url").exists()  # the test never ran
