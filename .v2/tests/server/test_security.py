"""Who may do what (docs/SECURITY.md): browser pages on other sites cannot drive the server (no text/plain, form or
multipart bodies; state-changing requests with a foreign Origin refused unless --allowed-origins lists it, which
then gets CORS headers), each API key is one tenant whatever the case of its ``Bearer`` scheme, and presets belong
to the key that made them unless the admin key shares them.

The app runs in this process (Starlette's TestClient, whose requests are addressed to ``http://testserver``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from app.server import create_app
from app.settings import ServerSettings
from engine.config import EngineConfig
from tests.server_harness import SMALL_KV_GIB, one_torch_thread

pytestmark = pytest.mark.slow

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"
ALLOWED = "http://allowed.example"
EVIL = "http://evil.example"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServerSettings(
        api_key=f"{ALICE},{BOB}",
        admin_api_key=ADMIN,
        allowed_origins=ALLOWED,
        session_store="memory",
        engine=EngineConfig(kv_cache_memory_gib=float(SMALL_KV_GIB), max_model_len=256),
    )
    with (
        one_torch_thread(),
        TestClient(create_app(settings), raise_server_exceptions=False) as client,
    ):
        yield client


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


def assert_error(response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


# what a page on another site can send without a CORS preflight: a "simple" request
SIMPLE_BODIES = {
    "text/plain": json.dumps({"title": "planted"}),
    "application/x-www-form-urlencoded": "title=planted",
    "multipart/form-data; boundary=xyz": '--xyz\r\nContent-Disposition: form-data; name="title"\r\n\r\nplanted\r\n--xyz--',
}


@pytest.mark.parametrize("content_type", list(SIMPLE_BODIES))
@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/chat/completions", "/v1/presets"])
def test_cross_origin_text_plain_is_refused(client: TestClient, content_type: str, path: str):
    body = SIMPLE_BODIES[content_type]
    cross_site = client.post(
        path, content=body, headers=auth(ALICE, **{"Content-Type": content_type, "Origin": EVIL})
    )
    assert_error(cross_site, 403, "cross_origin_refused")
    assert "access-control-allow-origin" not in cross_site.headers
    no_origin = client.post(
        path, content=body, headers=auth(ALICE, **{"Content-Type": content_type})
    )
    assert_error(no_origin, 415, "unsupported_media_type")
    assert client.get("/v1/sessions", headers=auth(ALICE)).json()["data"] == []


def test_cross_origin_json_is_refused_too(client: TestClient):
    """A browser would ask first (a preflight, refused: EVIL is not listed); a refusal must not depend on it."""
    response = client.post(
        "/v1/sessions", json={"title": "planted"}, headers=auth(ALICE, Origin=EVIL)
    )
    assert_error(response, 403, "cross_origin_refused")
    preflight = client.options(
        "/v1/sessions",
        headers={
            "Origin": EVIL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert "access-control-allow-origin" not in preflight.headers
    assert client.get("/v1/sessions", headers=auth(ALICE)).json()["data"] == []


def test_same_origin_browser_requests_pass(client: TestClient):
    own_page = client.post(
        "/v1/sessions", json={"title": "from the UI"}, headers=auth(BOB, Origin="http://testserver")
    )
    assert own_page.status_code == 201, own_page.text
    # Host rewritten, fetch metadata kept
    behind_a_proxy = client.post(
        "/v1/sessions",
        json={"title": "via nginx"},
        headers=auth(BOB, Origin="https://chat.example", **{"Sec-Fetch-Site": "same-origin"}),
    )
    assert behind_a_proxy.status_code == 201, behind_a_proxy.text
    same_site = client.post(
        "/v1/sessions",
        json={"title": "x"},
        headers=auth(BOB, Origin="http://testserver:3000", **{"Sec-Fetch-Site": "same-site"}),
    )
    assert_error(same_site, 403, "cross_origin_refused")  # another port is another origin
    titles = {s["title"] for s in client.get("/v1/sessions", headers=auth(BOB)).json()["data"]}
    assert titles == {"from the UI", "via nginx"}


def test_listed_origin_may_call_the_api_and_read_the_answers(client: TestClient):
    preflight = client.options(
        "/v1/sessions",
        headers={
            "Origin": ALLOWED,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    created = client.post("/v1/sessions", json={}, headers=auth(BOB, Origin=ALLOWED))
    assert created.status_code == 201 and created.headers["access-control-allow-origin"] == ALLOWED
    assert (
        "X-Session-ID"
        in client.post(
            "/v1/sessions/" + created.json()["id"] + "/messages",
            json={"content": "Hi", "max_tokens": 2},
            headers=auth(BOB, Origin=ALLOWED),
        ).headers["access-control-expose-headers"]
    )
    foreign_read = client.get("/v1/sessions", headers=auth(BOB, Origin=EVIL))
    assert (
        foreign_read.status_code == 200
        and "access-control-allow-origin" not in foreign_read.headers
    )


@pytest.mark.parametrize(
    "authorization",
    [f"bearer {ALICE}", f"BEARER {ALICE}", f"Bearer   {ALICE}  ", f"bEaReR {ALICE}"],
)
def test_bearer_scheme_is_case_insensitive_and_one_tenant_per_key(
    client: TestClient, authorization: str
):
    created = client.post("/v1/sessions", json={"title": "alice's"}, headers=auth(ALICE))
    session_id = created.json()["id"]
    same_key = client.get(f"/v1/sessions/{session_id}", headers={"Authorization": authorization})
    assert same_key.status_code == 200 and same_key.json()["title"] == "alice's"
    assert client.get(f"/v1/sessions/{session_id}", headers=auth(BOB)).status_code == 404
    listed = client.get("/v1/sessions?limit=1000", headers={"Authorization": authorization}).json()[
        "data"
    ]
    assert session_id in {s["id"] for s in listed}
    assert client.delete(f"/v1/sessions/{session_id}", headers=auth(ALICE)).status_code == 200


def test_presets_belong_to_their_key_and_only_the_admin_shares_them(client: TestClient):
    def names(key: str) -> set[tuple[str, bool, str]]:
        data = client.get("/v1/presets", headers=auth(key)).json()["data"]
        return {(p["name"], p["shared"], p["system"]) for p in data}

    assert (
        client.post(
            "/v1/presets", json={"name": "mine", "system": "Alice's voice."}, headers=auth(ALICE)
        ).status_code
        == 201
    )
    assert names(BOB) == set()
    assert (
        client.post(
            "/v1/presets",
            json={"name": "mine", "system": "Bob's voice."},
            # names are per key: no clash, nothing learnt
            headers=auth(BOB),
        ).status_code
        == 201
    )
    assert_error(
        client.post(
            "/v1/presets",
            json={"name": "house", "system": "x", "shared": True},
            headers=auth(ALICE),
        ),
        403,
        "permission_denied",
    )
    assert (
        client.post(
            "/v1/presets",
            json={"name": "house", "system": "The house style.", "shared": True},
            headers=auth(ADMIN),
        ).status_code
        == 201
    )
    assert names(ALICE) == {("mine", False, "Alice's voice."), ("house", True, "The house style.")}
    assert names(BOB) == {("mine", False, "Bob's voice."), ("house", True, "The house style.")}

    session = client.post("/v1/sessions", json={"preset": "mine"}, headers=auth(BOB)).json()
    assert session["system"] == "Bob's voice."
    assert_error(client.delete("/v1/presets/house", headers=auth(ALICE)), 403, "permission_denied")
    assert client.delete("/v1/presets/mine", headers=auth(ALICE)).status_code == 200
    assert names(BOB) == {("mine", False, "Bob's voice."), ("house", True, "The house style.")}
    assert client.delete("/v1/presets/house", headers=auth(ADMIN)).status_code == 200
    assert names(ALICE) == set()


def test_health_and_the_ui_need_no_key(client: TestClient):
    assert client.get("/health").status_code == 200
    assert client.get("/").status_code == 200
    assert_error(client.get("/v1/models"), 401, "invalid_api_key")
    # the admin key is a key too
    assert client.get("/v1/models", headers=auth(ADMIN)).status_code == 200
    assert client.get("/ping").status_code == 200 and client.get("/version").status_code == 200
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1, 2]})):
        # the tokenizer's work: keyed
        assert_error(client.post(path, json=body), 401, "invalid_api_key")
        assert client.post(path, json=body, headers=auth(BOB)).status_code == 200
