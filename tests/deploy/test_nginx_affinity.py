"""docker/nginx.conf under Debian's nginx (/usr/sbin/nginx, run unprivileged under a temporary prefix), with the
upstream list (docker/nginx-upstream.conf in the image) replaced by local servers on free ports.

First against small stub replicas (fast: affinity, spread, fail-over, unbuffered SSE), then against two real
pagedchat processes sharing one Redis (slow): one X-Session-ID stays on one replica, sessions spread over
both, and a session whose replica stops is continued, with its history, by the other.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from test_docker_native import (
    DOCKER_DIR,
    AppProcess,
    RedisServer,
    base_env,
    free_port,
    sse_events,
    start_redis,
    stop_process,
)

NGINX = Path("/usr/sbin/nginx")
_DOCKER_LISTEN = "listen 8080;"


def _require_nginx() -> None:
    if not NGINX.is_file():
        pytest.fail(f"{NGINX} is not installed (Debian package nginx; .ci/run installs it)")


def _upstream_include_name() -> str:
    block = re.search(
        r"upstream\s+pagedchat\s*\{(.*?)\}", (DOCKER_DIR / "nginx.conf").read_text(), re.DOTALL
    ).group(1)
    return re.search(r"include\s+(\S+);", block).group(1)


def write_nginx_prefix(
    prefix: Path, servers: list[str], port: int, upstream_text: str | None = None
) -> Path:
    """docker/nginx.conf listening on 127.0.0.1:port, its upstream include listing ``servers`` (host:port)."""
    conf = (DOCKER_DIR / "nginx.conf").read_text()
    assert conf.count(_DOCKER_LISTEN) == 1
    prefix.mkdir(parents=True, exist_ok=True)
    (prefix / "nginx.conf").write_text(conf.replace(_DOCKER_LISTEN, f"listen 127.0.0.1:{port};"))
    if upstream_text is None:
        upstream_text = "".join(
            f"server {server} max_fails=1 fail_timeout=10s;\n" for server in servers
        )
    (prefix / _upstream_include_name()).write_text(upstream_text)
    return prefix / "nginx.conf"


def nginx_argv(prefix: Path, *extra: str) -> list[str]:
    return [
        str(NGINX),
        "-p",
        str(prefix),
        "-c",
        str(prefix / "nginx.conf"),
        "-e",
        "stderr",
        "-g",
        f"pid {prefix}/nginx.pid; daemon off;",
        *extra,
    ]


@dataclass
class Nginx:
    prefix: Path
    port: int
    process: subprocess.Popen
    client: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.prefix / "nginx.log").read_text(errors="replace")


def start_nginx(prefix: Path, servers: list[str]) -> Nginx:
    _require_nginx()
    port = free_port()
    write_nginx_prefix(prefix, servers, port)
    with open(prefix / "nginx.log", "wb") as log:
        process = subprocess.Popen(nginx_argv(prefix), stdout=log, stderr=subprocess.STDOUT)
    nginx = Nginx(prefix, port, process)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"nginx exited with {process.returncode}:\n{nginx.log()}")
        try:
            httpx.get(f"{nginx.url}/", timeout=1)
            return nginx
        except httpx.TransportError:
            time.sleep(0.05)
    stop_process(process)
    raise AssertionError(f"nginx did not listen within 10 s:\n{nginx.log()}")


# --- stub replicas ----------------------------------------------------------------------------------------


class StubReplica:
    """A tiny HTTP server that says who it is; ``/sse`` sends one event, waits a second, sends another."""

    def __init__(self, name: str) -> None:
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/sse":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for n in (1, 2):
                        self.wfile.write(f"data: {n}\n\n".encode())
                        self.wfile.flush()
                        if n == 1:
                            time.sleep(1.0)
                    return
                body = json.dumps(
                    {"replica": replica.name, "session": self.headers.get("X-Session-ID")}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.name = name
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stubs(tmp_path: Path) -> Iterator[tuple[Nginx, dict[str, StubReplica]]]:
    _require_nginx()
    replicas = {name: StubReplica(name) for name in ("a", "b")}
    nginx = start_nginx(tmp_path / "nginx", [r.address for r in replicas.values()])
    nginx.client = httpx.Client(base_url=nginx.url, timeout=10)
    yield nginx, replicas
    nginx.client.close()
    stop_process(nginx.process)
    for replica in replicas.values():
        replica.stop()


def _replica(nginx: Nginx, path: str = "/who", session: str | None = None) -> str:
    headers = {"X-Session-ID": session} if session else {}
    response = nginx.client.get(path, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["replica"]


def test_nginx_accepts_the_config(tmp_path: Path) -> None:
    _require_nginx()
    write_nginx_prefix(tmp_path, ["127.0.0.1:9", "127.0.0.1:10"], free_port())
    done = subprocess.run(
        nginx_argv(tmp_path, "-t"), check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def test_nginx_accepts_the_docker_upstream_list_where_it_supports_resolve(tmp_path: Path) -> None:
    """docker/nginx-upstream.conf uses `resolve` (nginx >= 1.27.3, as in the compose image); older nginx
    builds, such as Debian bookworm's 1.22, cannot parse it."""
    _require_nginx()
    version = subprocess.run([str(NGINX), "-v"], check=False, capture_output=True, text=True).stderr
    major, minor, patch = map(int, re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", version).groups())
    if (major, minor, patch) < (1, 27, 3):
        pytest.skip(f"{version.strip()} has no `resolve` for upstream servers")
    write_nginx_prefix(tmp_path, [], free_port(), (DOCKER_DIR / "nginx-upstream.conf").read_text())
    done = subprocess.run(
        nginx_argv(tmp_path, "-t"), check=False, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def test_every_request_of_a_session_reaches_the_same_replica(stubs) -> None:
    nginx, _ = stubs
    for n in range(8):
        session = f"session-{n}"
        seen = {_replica(nginx, session=session) for _ in range(5)}
        # the sessions API names the session in the path instead of the header: same key, same replica
        seen |= {_replica(nginx, path=f"/v1/sessions/{session}/messages") for _ in range(2)}
        assert len(seen) == 1, (session, seen)


def test_different_sessions_spread_over_the_replicas(stubs) -> None:
    nginx, _ = stubs
    placement = {_replica(nginx, session=f"s{n}") for n in range(16)}  # all on one: p = 2**-15
    assert placement == {"a", "b"}


def test_requests_without_a_session_go_round_robin(stubs) -> None:
    nginx, _ = stubs
    seen = [_replica(nginx) for _ in range(6)]
    assert seen.count("a") == seen.count("b") == 3


def test_a_session_moves_to_another_replica_when_its_own_is_down(stubs) -> None:
    nginx, replicas = stubs
    home = _replica(nginx, session="wandering")
    replicas[home].stop()
    other = ({"a", "b"} - {home}).pop()
    assert _replica(nginx, session="wandering") == other
    assert _replica(nginx, session="wandering") == other


def test_sse_events_pass_through_without_buffering(stubs) -> None:
    """The first event arrives while the replica is still holding back the second (1 s later)."""
    nginx, _ = stubs
    start = time.monotonic()
    arrivals = []
    with httpx.stream("GET", f"{nginx.url}/sse", timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append((line, time.monotonic() - start))
    assert [line for line, _ in arrivals] == ["data: 1", "data: 2"]
    assert arrivals[0][1] < 0.8 and arrivals[1][1] >= 0.9, arrivals


# --- two real replicas ------------------------------------------------------------------------------------

REPLICA_NAMES = ("replica-a", "replica-b")


@dataclass
class Deployment:
    redis: RedisServer
    replicas: dict[str, AppProcess]
    nginx: Nginx

    def ensure_running(self) -> None:
        stopped = [app for app in self.replicas.values() if not app.running]
        for app in stopped:
            app.start()
        for app in stopped:
            app.wait_healthy()

    def wait_whole(self, timeout_s: float = 30.0) -> None:
        """Until nginx sends requests without a session to every replica: one it marked down after a failed
        attempt (``max_fails=1``: for ``fail_timeout``, 10 s) is back in the ring before placement is judged."""
        deadline, seen = time.monotonic() + timeout_s, set()
        while seen != set(REPLICA_NAMES) and time.monotonic() < deadline:
            seen.add(self.model_behind())
            time.sleep(0.05)
        assert seen == set(REPLICA_NAMES), seen

    def model_behind(self, session: str | None = None) -> str:
        headers = {"X-Session-ID": session} if session else {}
        response = httpx.get(f"{self.nginx.url}/v1/models", headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[Deployment]:
    _require_nginx()
    tmp = tmp_path_factory.mktemp("scale")
    redis = start_redis(tmp / "redis")
    replicas = {}
    for name in REPLICA_NAMES:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "app",
            "serve",
            "--port",
            str(port),
            "--kv-cache-memory-gib",
            "0.1",
            "--num-threads",
            "1",
            "--redis-url",
            redis.url,
            "--served-model-name",
            name,
        ]
        replicas[name] = AppProcess(argv, base_env(), port, tmp / f"{name}.log").start()
    try:
        for app in replicas.values():
            app.wait_healthy()
        nginx = start_nginx(tmp / "nginx", [f"127.0.0.1:{app.port}" for app in replicas.values()])
    except BaseException:
        for app in replicas.values():
            app.stop()
        stop_process(redis.process)
        raise
    yield Deployment(redis, replicas, nginx)
    stop_process(nginx.process)
    for app in replicas.values():
        app.stop()
    stop_process(redis.process)


@pytest.mark.slow
def test_replicas_keep_each_session_on_one_replica_and_spread_sessions(
    deployment: Deployment,
) -> None:
    deployment.ensure_running()
    deployment.wait_whole()
    placement = {}
    for n in range(12):
        session = f"sess-{n}"
        seen = {deployment.model_behind(session) for _ in range(3)}
        assert len(seen) == 1, (session, seen)
        placement[session] = seen.pop()
    assert set(placement.values()) == set(REPLICA_NAMES)  # all on one: p = 2**-11


@pytest.mark.slow
def test_replicas_share_requests_without_a_session(deployment: Deployment) -> None:
    deployment.ensure_running()
    assert {deployment.model_behind() for _ in range(4)} == set(REPLICA_NAMES)


@pytest.mark.slow
def test_chat_through_nginx_answers_and_streams(deployment: Deployment) -> None:
    deployment.ensure_running()
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
    reply = httpx.post(f"{deployment.nginx.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] in REPLICA_NAMES
    streamed = httpx.post(
        f"{deployment.nginx.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    assert {json.loads(event)["model"] for event in events[:-1]} <= set(REPLICA_NAMES)


@pytest.mark.slow
def test_a_session_continues_with_its_history_on_the_other_replica(deployment: Deployment) -> None:
    deployment.ensure_running()
    url = deployment.nginx.url
    created = httpx.post(f"{url}/v1/sessions", json={"system": "Answer in one word."}, timeout=30)
    assert created.status_code == 201, created.text
    session = created.json()["id"]
    turn = {"max_tokens": 3, "temperature": 0}

    first = httpx.post(
        f"{url}/v1/sessions/{session}/messages",
        json={"content": "Name a colour.", **turn},
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert first.status_code == 200, first.text
    home = first.json()["model"]
    assert deployment.model_behind(session) == home
    deployment.replicas[home].stop()

    second = httpx.post(
        f"{url}/v1/sessions/{session}/messages",
        json={"content": "Name a fruit.", **turn},
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert second.status_code == 200, second.text
    assert second.json()["model"] != home
    stored = httpx.get(f"{url}/v1/sessions/{session}", timeout=30).json()
    messages = [(m["role"], m["content"]) for m in stored["messages"]]
    assert [role for role, _ in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0][1] == "Name a colour." and messages[2][1] == "Name a fruit."
    assert messages[1][1] == first.json()["choices"][0]["message"]["content"]
    assert messages[3][1] == second.json()["choices"][0]["message"]["content"]
    assert stored["system"] == "Answer in one word."
