"""The local servers the tests use, and what each test process owns of them.

Under pytest-xdist every worker (gw0, gw1, ...) has a Redis database of its
own. On a laptop without Redis the tests that need it skip; in CI
(PARALON_REQUIRE_SERVICES=1) a missing server is a failure, never a skip."""
from __future__ import annotations

import os

import pytest
import redis

REDIS_BASE_URL = os.environ.get("PARALON_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REQUIRE_SERVICES = os.environ.get("PARALON_REQUIRE_SERVICES") == "1"
# pytest-xdist names its workers gw0, gw1, ...; without it there is one process.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
WORKER_NUMBER = int(XDIST_WORKER.removeprefix("gw")) if XDIST_WORKER.startswith("gw") else 0
REDIS_DB = WORKER_NUMBER + 1  # gw0 -> 1, gw1 -> 2, ...; db 0 is left to whatever else runs on the server


def worker_redis_url() -> str:
    """PARALON_TEST_REDIS_URL with this test process's own database number."""
    return REDIS_BASE_URL.rsplit("/", 1)[0] + f"/{REDIS_DB}"


@pytest.fixture
def redis_url() -> str:
    """This test process's own Redis database (PARALON_TEST_REDIS_URL with db 1 for gw0, 2 for gw1, ...)."""
    url = worker_redis_url()
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError:
        if REQUIRE_SERVICES:
            raise
        pytest.skip("Redis is not reachable at PARALON_TEST_REDIS_URL")
    finally:
        client.close()
    return url
