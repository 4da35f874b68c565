"""docker/compose.yml's shared tier of KV blocks (issue 52): a Redis of its own for the scale profile, bounded and
evicting least recently used keys, never persisted (a cache: the sessions' Redis keeps its append-only file), and
the replicas reach it through PAGEDCHAT_KV_REDIS_URL, empty (no Redis tier) unless docker/.env sets it."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from test_docker_native import DOCKER_DIR, interpolate, load_compose

REPLICAS = ["app", "app-2", "app-3"]


def test_the_kv_redis_is_bounded_evicts_lru_and_keeps_nothing_on_disk():
    services = load_compose()["services"]
    kv = services["redis-kv"]
    assert kv["profiles"] == ["scale"]  # plain `up` stays Redis + one server
    command = kv["command"]
    option = {command[i]: command[i + 1] for i in range(1, len(command) - 1, 2)}
    assert option["--maxmemory"] == "2gb" and option["--maxmemory-policy"] == "allkeys-lru"
    assert option["--save"] == "" and option["--appendonly"] == "no" and "volumes" not in kv
    assert kv["image"] == services["redis"]["image"]
    assert kv["healthcheck"] == services["redis"]["healthcheck"]


def test_the_replicas_take_the_kv_redis_url_from_the_environment_and_the_example_names_redis_kv():
    services = load_compose()["services"]
    for name in REPLICAS:
        value = services[name]["environment"]["PAGEDCHAT_KV_REDIS_URL"]
        assert interpolate(value, {}) == ""  # off unless set
        url = "redis://redis-kv:6379/0"
        assert interpolate(value, {"PAGEDCHAT_KV_REDIS_URL": url}) == url
    example = (DOCKER_DIR / ".env.example").read_text()
    suggested = re.search(r"redis://redis-kv:\d+/\d+", example).group(0)
    assert urlsplit(suggested).hostname in services and urlsplit(suggested).port == 6379
