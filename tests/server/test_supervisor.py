"""The supervisor of front processes (app/supervisor.py): a front killed while another serves ends that one's
streams at once with the engine's error event and the server exits 3; ``--restart-core`` replaces a dead core
(and its fronts) on the same port, so the next request succeeds on a new core; its restarts are bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.test_engine_process import (
    child_processes,
    data_events,
    process_gone,
    stream_body,
    wait_until,
)
from tests.server.test_api_servers import children_of
from tests.server_harness import RunningServer, running_server


def front_holding(response: httpx.Response, server: RunningServer, fronts: list[int]) -> int:
    """The front process that holds ``response``'s connection: the server side of it in /proc/net/tcp (local
    port the server's, remote port the client's), found among each front's open sockets."""
    client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    server_port = int(server.base_url.rsplit(":", 1)[1])
    sockets = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, remote_port = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
        if (local_port, remote_port) == (server_port, client_port):
            sockets.add(f"socket:[{fields[9]}]")
    holders = []
    for pid in fronts:
        links = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        if links & sockets:
            holders.append(pid)
    (holder,) = holders
    return holder


def cores_of(pid: int) -> set[int]:
    """The runner's engine cores, known by the name each gives itself as it starts (a front just spawned is
    not in its own process group yet, so ``children_of`` could take it for a core)."""
    cores = set()
    for child in child_processes(pid, b"spawn_main"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == "pagedchat-core":
                cores.add(child)
    return cores


def test_a_front_killed_ends_the_other_fronts_streams_with_an_error_at_once_and_exits_3():
    with running_server("--api-server-count", "2") as server:
        fronts, cores = children_of(server.process.pid)
        with httpx.stream(
            "POST", server.url("/v1/chat/completions"), json=stream_body(2000), timeout=60
        ) as response:
            events = data_events(response)
            next(events), next(events)  # streaming
            serving = front_holding(response, server, fronts)
            (other,) = set(fronts) - {serving}
            os.kill(other, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(events)
            took = time.monotonic() - killed
        assert rest[-1] == "[DONE]" and '"engine_unavailable"' in rest[-2]
        # (its drain would have let it run on for up to --shutdown-timeout-s, 30 s)
        assert took < 3, took
        assert server.process.wait(30) == 3
        assert wait_until(lambda: all(process_gone(pid) for pid in fronts + cores), 10)


def test_restart_core_gives_the_dead_cores_stream_an_error_then_serves_on_a_new_core():
    with running_server("--api-server-count", "2", "--restart-core") as server:
        fronts, (core,) = children_of(server.process.pid)
        with httpx.stream(
            "POST", server.url("/v1/chat/completions"), json=stream_body(2000), timeout=60
        ) as response:
            events = data_events(response)
            next(events), next(events)
            os.kill(core, signal.SIGKILL)
            rest = list(events)
        assert rest[-1] == "[DONE]" and '"engine_unavailable"' in rest[-2]
        assert wait_until(lambda: all(process_gone(pid) for pid in fronts), 30)
        # sent while the new fronts start: it waits on the listening socket, which the supervisor kept open
        reply = httpx.post(
            server.url("/v1/chat/completions"),
            json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        new_fronts, (new_core,) = children_of(server.process.pid)
        assert new_core != core and len(new_fronts) == 2 and not set(new_fronts) & set(fronts)
        assert server.process.poll() is None
        assert (
            f"engine core (pid {core}, status -9) died: restarting it and the 2 front processes "
            "(restart 1 of at most 3 within 600 s)" in server.log()
        )


def test_a_core_that_keeps_dying_is_restarted_at_most_max_core_restarts_times_then_exits_3():
    # (one front: --restart-core alone runs the single front under the supervisor too)
    with running_server("--restart-core", "--max-core-restarts", "1") as server:
        (core,) = cores_of(server.process.pid)
        os.kill(core, signal.SIGKILL)
        # the new core dies as it starts: the one restart allowed is spent
        assert wait_until(lambda: cores_of(server.process.pid) - {core}, 60)
        (new_core,) = cores_of(server.process.pid) - {core}
        os.kill(new_core, signal.SIGKILL)
        assert server.process.wait(60) == 3
        assert (
            f"(pid {new_core}, status -9) died again after 1 restarts within 600 s" in server.log()
        )


def test_restart_core_refuses_sessions_in_memory_and_a_bound_below_one():
    from app.settings import ServerSettings

    with pytest.raises(ValueError, match="restart_core: a restart replaces the front processes"):
        ServerSettings(restart_core=True, session_store="memory")
    with pytest.raises(ValueError, match=r"max_core_restarts: must be in \[1, 100\]"):
        ServerSettings(restart_core=True, max_core_restarts=0)
