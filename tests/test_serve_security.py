"""Exposure of the HTTP front (issue 38, finding 2 and acceptance 4): `--api-key` (401 without it on every
endpoint but a bare /health), the Host allow-list (403), JSON endpoints only for `application/json` (415),
CORS only for the origins `--cors-origin` names.  Loopback only."""
from __future__ import annotations

import httpx
import pytest

from serve_util import API_KEY, raw_http, serve, status_of

ENDPOINTS = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
             ("POST", "/tokenize", {"content": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
             ("GET", "/metrics", None), ("GET", "/props", None)]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("sec"), "--cors-origin", "http://app.example", "--allow-host", "llm.lan",
              api_key=API_KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def open_daemon(tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("sec-open"))
    yield s
    s.stop()


def _call(s, method, path, body, headers):
    return httpx.request(method, s.url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
def test_api_key_required(guarded, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"X-Api-Key": "wrong"}):
        r = _call(guarded, method, path, body, headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and "API key" in err["message"]
    for headers in ({"Authorization": f"Bearer {API_KEY}"}, {"X-Api-Key": API_KEY}):
        assert _call(guarded, method, path, body, headers).status_code == 200


def test_health_is_a_bare_liveness_check_without_the_key(guarded):
    r = httpx.get(guarded.url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    full = httpx.get(guarded.url + "/health", headers=guarded.headers(), timeout=10).json()
    assert full["status"] == "ok" and "pid" in full and "target" in full


def test_openai_client_with_the_key(guarded):
    openai = pytest.importorskip("openai")
    ok = openai.OpenAI(base_url=guarded.url + "/v1", api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model="m", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.2", "localhost.evil.example"])
def test_foreign_host_is_refused(guarded, open_daemon, host):
    for s in (guarded, open_daemon):
        for path in ("/health", "/v1/models"):
            r = httpx.get(s.url + path, headers={**s.headers(), "Host": host}, timeout=10)
            assert r.status_code == 403 and "Host" in r.json()["error"]["message"], (host, r.text)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "LOCALHOST", "llm.lan"])
def test_local_hosts_are_allowed(guarded, host):
    r = httpx.get(guarded.url + "/health", headers={"Host": f"{host}:{guarded.port}"}, timeout=10)
    assert r.status_code == 200


def test_allow_host_adds_to_the_list_only_where_given(open_daemon):
    r = httpx.get(open_daemon.url + "/health", headers={"Host": "llm.lan"}, timeout=10)
    assert r.status_code == 403


def test_missing_host_header_is_refused(open_daemon):
    resp = raw_http(open_daemon.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert status_of(resp) == 403


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                   None, "application/json; charset=latin-1"])
def test_json_endpoints_need_application_json(guarded, open_daemon, ctype):
    body = b'{"prompt": "x", "max_tokens": 1}'
    for s in (guarded, open_daemon):
        headers = {**s.headers(), **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(s.url + "/v1/completions", content=body, headers=headers, timeout=10)
        assert r.status_code == 415, (ctype, r.text)
        assert "application/json" in r.json()["error"]["message"]
    r = httpx.post(open_daemon.url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200


def test_cors_only_for_named_origins(guarded, open_daemon):
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(guarded.url + "/v1/chat/completions", headers=pre, timeout=10)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.get(guarded.url + "/v1/models", headers={**guarded.headers(), "Origin": "http://app.example"},
                  timeout=10)
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(guarded.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"},
                      timeout=10)
    assert "access-control-allow-origin" not in r.headers
    # without --cors-origin: no CORS headers at all, so a browser page may not read replies
    for s in (open_daemon,):
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.options(s.url + "/v1/chat/completions", headers=pre, timeout=10)
        assert "access-control-allow-origin" not in r.headers


def test_api_key_from_the_environment(tmp_path):
    s = serve(tmp_path, env={"DFLASH27B_API_KEY": "from-env"})
    try:
        assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer from-env"},
                         timeout=10).status_code == 200
    finally:
        s.stop()


def test_guard_flags_need_http(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", str(tmp_path / "s.sock"),
                        "--api-key", "k"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--http" in r.stderr and not (tmp_path / "s.sock").exists()


def test_host_names_are_compared_without_port_case_or_trailing_dot():
    from dflash27b.http_guard import allowed_hosts, host_name
    names = allowed_hosts("::1", ("llm.lan:8000", "LLM2.LAN.", "fe80::1"))
    assert {"localhost", "127.0.0.1", "[::1]", "llm.lan", "llm2.lan", "[fe80::1]"} <= names
    assert [host_name(h) for h in (b"LLM.lan.:80", b"[fe80::1]:8000", b"127.0.0.1", b"a:b:c", b"", None)] == [
        "llm.lan", "[fe80::1]", "127.0.0.1", None, None, None]
    assert allowed_hosts("127.0.0.1", ("*",)) is None


def test_refusals_do_not_list_the_served_names(guarded, open_daemon):
    """The 403 goes to anyone, key or not: it names the Host it refused, not the names the server answers to."""
    r = httpx.get(guarded.url + "/health", headers={"Host": "evil.example"}, timeout=10)
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    assert "llm.lan" not in r.text and "localhost" not in r.text, r.text
    resp = raw_http(open_daemon.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert b"without a Host header" in resp, resp


def test_a_refused_cors_preflight_is_json(guarded):
    pre = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(guarded.url + "/v1/chat/completions", headers=pre, timeout=10)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert "origin" in r.json()["error"]["message"], r.text


def test_connections_past_the_limit_get_a_json_503(tmp_path):
    """--max-connections: a request on a connection past the limit gets OpenAI's error shape and Retry-After
    (uvicorn's own limit answered plain text); a connection under it is served."""
    import socket
    s = serve(tmp_path, "--max-connections", "2")
    held = []
    try:
        for _ in range(2):   # two idle connections hold the limit
            c = socket.create_connection(("127.0.0.1", s.port))
            held.append(c)
        import time
        time.sleep(0.2)
        resp = raw_http(s.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert status_of(resp) == 503, resp
        assert b"retry-after: 1" in resp.lower() and b"--max-connections" in resp, resp
        for c in held:
            c.close()
        time.sleep(0.2)
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        for c in held:
            c.close()
        s.stop()
