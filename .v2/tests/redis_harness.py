"""A real ``redis-server`` on a free port for tests (installed by .ci/run; the tests fail loudly without it).

``RedisServer`` can be stopped and started again on the same port with the same data directory, which is how
the tests take Redis away from a running pagedchat server and bring it back.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_harness import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    def __init__(self) -> None:
        if not Path(REDIS_SERVER).exists():
            pytest.fail(
                "redis-server is not installed (apt-get install redis-server; .ci/run does it)"
            )
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pagedchat-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        # append-only file on, so a stop/start keeps the data as the compose deployment does
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                pytest.fail(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, decode_responses=True)

    def _answers(self) -> bool:
        import redis

        with contextlib.suppress(redis.exceptions.ConnectionError):
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        return False

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
