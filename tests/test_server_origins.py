"""Cross-site requests (issue 43, item 8): a web page on another site cannot drive a local server.

A browser sends a "simple" POST (``Content-Type: text/plain``) from any page without asking first,
with an ``Origin`` header naming the page's site. Those are refused with a 403 on every route but the
health check, unless ``--cors-origins`` allows the site; requests without an ``Origin`` (curl, the
SDKs) and from the server's own page are served as before.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra brings httpx")
pytest.importorskip("uvicorn", reason="the server extra brings uvicorn")
from click.testing import CliRunner  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from pyllama_spec.server.origins import CrossSiteGuard, OriginPolicy  # noqa: E402

EVIL = "http://evil.example"
COMPLETION = json.dumps({"prompt": "def f(", "n_predict": 2, "temperature": 0})


def _simple_post(url: str, path: str, body: str, origin: str | None) -> httpx.Response:
    """What a page's <form> or fetch(..., {mode: "no-cors"}) sends: text/plain, no preflight."""
    headers = {"Content-Type": "text/plain"} | ({"Origin": origin} if origin else {})
    return httpx.post(url + path, content=body, headers=headers, timeout=60)


def test_a_foreign_page_is_refused_on_routes_that_act_and_served_on_health(tiny_server):
    url = tiny_server.url
    lora_before = httpx.get(url + "/lora-adapters", timeout=30).json()
    for path, body in [("/completion", COMPLETION), ("/lora-adapters", json.dumps([{"id": 0, "scale": 0.5}])),
                       ("/slots/0?action=erase", ""), ("/v1/chat/completions", "{}")]:
        r = _simple_post(url, path, body, EVIL)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "origin_not_allowed" and EVIL in err["message"] and "--cors-origins" in err["message"]
        assert "access-control-allow-origin" not in r.headers
    assert httpx.get(url + "/lora-adapters", timeout=30).json() == lora_before
    assert httpx.get(url + "/health", headers={"Origin": EVIL}, timeout=30).status_code == 200
    # a page opened from a file, or a sandboxed frame, says "null": not this server's page either
    assert _simple_post(url, "/completion", COMPLETION, "null").status_code == 403


def test_clients_without_an_origin_the_servers_own_page_and_local_pages_are_served(tiny_server):
    url = tiny_server.url  # http://127.0.0.1:PORT
    assert _simple_post(url, "/completion", COMPLETION, None).status_code == 200
    assert _simple_post(url, "/completion", COMPLETION, url).status_code == 200  # the chat page at /
    local = "http://localhost:5173"  # a page under development on this machine (the default allows it)
    r = _simple_post(url, "/completion", COMPLETION, local)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == local
    pre = httpx.options(url + "/v1/chat/completions", timeout=30, headers={
        "Origin": local, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == local
    assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    # a foreign page's preflight: answered as llama-server does, without leave to go on
    pre = httpx.options(url + "/v1/chat/completions", timeout=30, headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and "access-control-allow-origin" not in pre.headers
    # a page elsewhere that only looks local is not
    for origin in ("http://localhost.evil.example", "http://127.0.0.1.evil.example:8080"):
        assert _simple_post(url, "/completion", COMPLETION, origin).status_code == 403


def _app(policy: OriginPolicy, base_url: str = "http://server:8080") -> TestClient:
    async def act(request):
        return JSONResponse({"acted": True})

    app = Starlette(routes=[Route("/act", act, methods=["POST", "GET"]), Route("/health", act, methods=["GET"])],
                    middleware=[Middleware(CrossSiteGuard, policy=policy)])
    return TestClient(app, base_url=base_url)


@pytest.mark.parametrize("value, allowed, refused", [
    ("localhost", ["http://localhost", "https://127.0.0.1:3000", "http://[::1]:8000"],
     [EVIL, "http://192.168.1.5:3000", "null"]),
    ("*", [EVIL, "null", "http://localhost"], []),
    ("https://app.example.com:443, http://localhost:3000", ["https://app.example.com", "https://APP.example.com/",
                                                             "http://localhost:3000"],
     ["http://app.example.com", "https://app.example.com:444", "http://localhost:3001", EVIL]),
])
def test_cors_origins_values_as_llama_server_names_them(value, allowed, refused):
    client = _app(OriginPolicy.parse(value))
    for origin in allowed:
        r = client.post("/act", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, origin
    for origin in refused:
        assert client.post("/act", headers={"Origin": origin}).status_code == 403, origin
    assert client.post("/act").status_code == 200
    assert client.post("/act", headers={"Origin": "http://server:8080"}).status_code == 200  # same origin


def test_a_bad_cors_origins_value_is_a_usage_error():
    from pyllama_spec.cli import main

    for bad in ("example.com", "ftp://example.com", "http://example.com/path"):
        with pytest.raises(ValueError, match="--cors-origins takes"):
            OriginPolicy.parse(bad)
    result = CliRunner().invoke(main, ["serve", "--cors-origins", "example.com"])
    assert result.exit_code == 2 and "--cors-origins" in result.output and "example.com" in result.output


def test_a_page_that_rebinds_its_name_to_this_machine_is_refused_on_a_loopback_server():
    """DNS rebinding: a page at http://rebind.attacker.example:8080 whose name now points at 127.0.0.1
    sends a matching Host and Origin (or none, on a GET): a server listening on loopback answers only
    requests for localhost or a loopback address (review of issue 43, item 8)."""
    policy = OriginPolicy.parse("localhost", listen_host="127.0.0.1")
    attacker = "http://rebind.attacker.example:8080"
    client = _app(policy, base_url=attacker)
    for headers in ({"Origin": attacker}, {}):
        r = client.post("/act", headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", r.text
    assert client.get("/health").status_code == 200
    for base in ("http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080"):
        assert _app(policy, base_url=base).post("/act").status_code == 200, base
    # listening on another address (the user exposed it), any name is served
    exposed = OriginPolicy.parse("localhost", listen_host="0.0.0.0")
    assert not exposed.loopback_host and _app(exposed, base_url=attacker).post("/act").status_code == 200
    assert OriginPolicy.parse(None, listen_host="localhost").loopback_host


def test_a_cross_site_request_without_an_origin_is_refused():
    """An <img src=".../props?model=big"> sends a GET without an Origin; browsers mark it
    Sec-Fetch-Site: cross-site (a router would load that model)."""
    client = _app(OriginPolicy.parse("localhost"))
    assert client.get("/act", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
    assert client.get("/act", headers={"Sec-Fetch-Site": "same-site"}).status_code == 200  # another local port
    assert client.get("/act", headers={"Sec-Fetch-Site": "same-origin"}).status_code == 200
    assert client.get("/act", headers={"Sec-Fetch-Site": "none"}).status_code == 200  # typed in the address bar
    assert client.get("/health", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200
    listed = _app(OriginPolicy.parse("https://app.example.com"))
    assert listed.get("/act", headers={"Sec-Fetch-Site": "same-site"}).status_code == 403
    assert _app(OriginPolicy.parse("*")).get("/act", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200


def test_a_proxy_that_keeps_the_name_a_link_to_the_page_and_other_loopback_forms_are_served():
    """Second review: a reverse proxy keeping its Host is served when --cors-origins names it; following a
    link to the chat page from another site is a navigation, not a request from that site; a loopback
    address written as IPv4-mapped IPv6 or with a trailing dot is loopback."""
    policy = OriginPolicy.parse("https://chat.example.com", listen_host="127.0.0.1")
    assert _app(policy, base_url="https://chat.example.com").post("/act").status_code == 200
    assert _app(policy, base_url="https://other.example.com").post("/act").status_code == 403
    for base in ("http://localhost.:8080", "http://[::ffff:127.0.0.1]:8080"):
        assert _app(policy, base_url=base).post("/act").status_code == 200, base
    local = _app(OriginPolicy.parse("localhost", listen_host="127.0.0.1"), base_url="http://127.0.0.1:8080")
    navigate = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
    assert local.get("/act", headers=navigate).status_code == 403  # only the page's own paths
    assert local.get("/", headers=navigate).status_code == 404  # served (this test app has no page)


def test_the_router_does_not_pass_the_browsers_headers_it_checked_to_its_models():
    from pyllama_spec.server.router.proxy import _REQUEST_HEADERS_DROPPED

    assert {"origin", "sec-fetch-site", "sec-fetch-mode"} <= _REQUEST_HEADERS_DROPPED
