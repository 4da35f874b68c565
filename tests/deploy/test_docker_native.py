"""What the containers of docker/compose.yml run, run natively: CI has no Docker engine, so the app service's
command and environment are taken from compose.yml (service host names become 127.0.0.1, ports free ones)
and started against a real local Redis; the image's build-time default-model step runs as the Dockerfile says.

Also the helpers the nginx tests share (free ports, a throw-away Redis, app processes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yml"
REDIS_SERVER = "/usr/bin/redis-server"
# The image's ENV that points into the image itself; natively the defaults (user cache, venv PATH) stand.
_IMAGE_ONLY_ENV = {"PATH", "PAGEDCHAT_CACHE_DIR"}
_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's variable substitution for the forms compose.yml uses: ``${VAR}``, ``${VAR:-default}``, ``$$``."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1)) or (match.group(2) or "")

    return _INTERPOLATION.sub(substitute, value)


def service_environment(service: dict, env: dict[str, str] | None = None) -> dict[str, str]:
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {key: interpolate(str(value), env or {}) for key, value in raw.items()}


def dockerfile_env(path: Path) -> dict[str, str]:
    """The ``ENV KEY=VALUE ...`` settings of a Dockerfile (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pagedchat_executable() -> list[str]:
    """The container's ``pagedchat`` console script: the one installed beside this Python, else ``-m app``."""
    script = Path(sys.executable).parent / "pagedchat"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "app"]


def native_command(command: list[str], port: int) -> list[str]:
    """A container command as it runs here: our executable, loopback only, a free port."""
    args = list(command)
    if args[0] == "pagedchat":
        args[:1] = pagedchat_executable()
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    return args


def native_redis_url(url: str, services: dict, redis_port: int) -> str:
    parts = urlsplit(url)
    assert parts.hostname in services, (
        f"REDIS_URL names {parts.hostname!r}, which is no compose service"
    )
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{redis_port}"))


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def start_redis(workdir: Path, *args: str) -> RedisServer:
    """A throw-away redis-server on a free loopback port (no RDB snapshots; AOF as ``args`` say)."""
    if not Path(REDIS_SERVER).is_file():
        pytest.fail(
            f"{REDIS_SERVER} is not installed (Debian package redis-server; .ci/run installs it)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [
        REDIS_SERVER,
        *args,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--dir",
        str(workdir),
    ]
    if "--appendonly" not in args:
        argv += ["--appendonly", "no"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return RedisServer(port, process)
        except OSError:
            time.sleep(0.05)
    stop_process(process)
    raise RuntimeError("redis-server did not answer PING within 10 s")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    yield server
    stop_process(server.process)


def stop_process(process: subprocess.Popen, timeout: float = 15.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class AppProcess:
    """One server process started as a replica would be; its output goes to ``log``."""

    argv: list[str]
    env: dict[str, str]
    port: int
    log: Path
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AppProcess:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return (
            "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
            if self.log.exists()
            else ""
        )


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment without settings a developer's shell may carry into the server."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PAGEDCHAT_API_KEY")}
    return {**env, **extra}


def healthcheck_argv(test: list[str], port: int) -> list[str]:
    """A compose ``healthcheck.test`` in exec form (``CMD``), pointed at the native server."""
    assert test[0] == "CMD", test
    argv = [arg.replace(":8000/", f":{port}/") for arg in test[1:]]
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def chat(base_url: str, content: str, max_tokens: int = 4, **kwargs) -> httpx.Response:
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120, **kwargs)


def sse_events(response: httpx.Response) -> list[str]:
    return [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]


# --- the app service of compose.yml, natively -------------------------------------------------------------


@pytest.mark.slow
def test_compose_app_command_and_environment_serve_health_and_chat(
    redis_server: RedisServer, default_model_dir: Path, tmp_path: Path
) -> None:
    compose = load_compose()
    service = compose["services"]["app"]
    port = free_port()
    container_env = {
        k: v
        for k, v in dockerfile_env(DOCKER_DIR / "Dockerfile").items()
        if k not in _IMAGE_ONLY_ENV
    }
    env = {**container_env, **service_environment(service)}
    env["REDIS_URL"] = native_redis_url(env["REDIS_URL"], compose["services"], redis_server.port)
    argv = native_command(service["command"], port) + [
        "--kv-cache-memory-gib",
        "0.1",
        "--num-threads",
        "2",
    ]
    app = AppProcess(argv, base_env(**env), port, tmp_path / "app.log").start()
    try:
        app.wait_healthy()
        probe = subprocess.run(
            healthcheck_argv(service["healthcheck"]["test"], port),
            check=False,
            capture_output=True,
            timeout=30,
        )
        assert probe.returncode == 0, probe.stderr.decode()

        reply = chat(app.base_url, "Say hello.")
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "chat.completion"
        assert isinstance(answer["choices"][0]["message"]["content"], str)
        assert 1 <= answer["usage"]["completion_tokens"] <= 4

        streamed = httpx.post(
            f"{app.base_url}/v1/chat/completions",
            timeout=120,
            json={
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 3,
                "stream": True,
            },
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed)
        assert events[-1] == "[DONE]"
        assert json.loads(events[0])["object"] == "chat.completion.chunk"

        # REDIS_URL from compose.yml is the session store (not the embedded in-memory one)
        store = redis.Redis(port=redis_server.port)
        before = store.dbsize()
        created = httpx.post(f"{app.base_url}/v1/sessions", json={"title": "compose"}, timeout=30)
        assert created.status_code == 201, created.text
        assert store.dbsize() > before
        store.close()
    finally:
        app.stop()
    # `docker stop` sends SIGTERM: a graceful shutdown (uvicorn re-raises the signal once it is done)
    assert app.process.returncode in (0, -signal.SIGTERM), app.log_tail()
    assert "Application shutdown complete" in app.log_tail()


@pytest.mark.slow
def test_image_model_step_runs_natively(default_model_dir: Path) -> None:
    """The Dockerfile's default-model RUN, run as written (with this Python): it finds or makes the default
    model's directory in PAGEDCHAT_CACHE_DIR (its config and tokenizer described from the packaged GGUF file,
    whose weights stay in the file; here the test cache, where conftest described it already)."""
    from engine.config import EngineConfig
    from engine.weights.gguf_model_dir import gguf_file_of
    from engine.worker.model_sources import default_gguf_file

    for name in ("Dockerfile", "Dockerfile.cuda"):
        step = next(run for run in run_steps(DOCKER_DIR / name) if "ensure_default_model" in run)
        command = step.split("&&")[0].strip()
        assert command.startswith("python -c "), command
        argv = [sys.executable, *shlex.split(command)[1:]]
        env = base_env(
            PAGEDCHAT_CACHE_DIR=EngineConfig().cache_dir,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        done = subprocess.run(
            argv, cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert Path(done.stdout.strip()) == default_model_dir
        assert gguf_file_of(default_model_dir) == default_gguf_file().resolve()
        assert (default_model_dir / "config.json").is_file()
        assert not list(default_model_dir.glob("*.safetensors"))  # no float copy of the weights


def run_steps(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_compose_interpolation_uses_defaults_and_given_values() -> None:
    assert interpolate("${PAGEDCHAT_PORT:-8000}:8000", {}) == "8000:8000"
    assert interpolate("${PAGEDCHAT_PORT:-8000}:8000", {"PAGEDCHAT_PORT": "9000"}) == "9000:8000"
    assert interpolate("${PAGEDCHAT_API_KEY:-}", {}) == ""
    assert interpolate("$${literal}", {}) == "${literal}"


def test_redis_from_compose_runs_natively_with_its_aof_and_healthcheck(tmp_path: Path) -> None:
    """compose.yml's redis command under the local redis-server: AOF on, and its healthcheck passes."""
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is not installed (Debian package redis-tools, with redis-server)")
    service = load_compose()["services"]["redis"]
    command = service["command"]
    assert command[0] == "redis-server"
    server = start_redis(tmp_path / "data", *command[1:])
    try:
        config_get = ["redis-cli", "-p", str(server.port), "CONFIG", "GET", "appendonly"]
        appendonly = subprocess.run(
            config_get, check=False, capture_output=True, text=True, timeout=10
        ).stdout.split()
        assert appendonly == ["appendonly", "yes"]
        subprocess.run(
            ["redis-cli", "-p", str(server.port), "SET", "k", "v"], check=True, capture_output=True
        )
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        probe_shell = test[1].replace("redis-cli", f"redis-cli -p {server.port}")
        probe = subprocess.run(
            ["sh", "-c", probe_shell], check=False, capture_output=True, timeout=10
        )
        assert probe.returncode == 0
        assert any((tmp_path / "data").rglob("*.aof")), "no append-only file was written"
    finally:
        stop_process(server.process)
