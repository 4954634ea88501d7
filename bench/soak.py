"""Soak: the daemon under many impatient, careless and hostile clients (issue 38, acceptance 1).

Starts its own `dflash27b serve` on the bundled tiny pair (Unix socket + HTTP on 127.0.0.1, with an API key),
then runs N clients for S seconds, each looping over a random mix of requests:

  stream / plain / socket   well-formed requests (completions and chat, streamed or not, random engine mode
                            and cache_prompt): each reply must equal a solo decode (temperature 0, computed
                            in-process before the run) character for character;
  cancel                    a long request given up after its first chunk (streamed) or after 0.2 s (plain,
                            socket): nothing more may be decoded for it (the daemon's after_cancel counters);
  timeout                   a long request with `timeout`: a prefix of the solo decode with stop_reason
                            "timeout", or a 503 naming the timeout when it never started;
  malformed / oversized     bad JSON, deep nesting, 4300-digit numbers, wrong types, refused fields, no key,
                            a foreign Host, text/plain, a prompt past the context, a body past --max-body,
                            half-sent headers, a deep line on the socket: each a clear 4xx (or error event).

Meanwhile a separate process polls GET /health every 50 ms (each answer must take < 100 ms), and the main
process samples the daemon's RSS and open fds.  Checks: every well-formed reply exact, every bad one a clear
4xx, RSS growth < 5% from the end of the warm-up to the end, fds back to the idle baseline, no decode step after
a cancel, /health < 100 ms throughout, SIGTERM at the end exits cleanly.  Loopback only; every loop is
bounded in time and count.

  python bench/soak.py [--clients 16] [--seconds 600] [--out bench/results/soak-cpu.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

API_KEY = "soak-key"
CTX = 1024
MAX_BODY = 256 << 10
READ_TIMEOUT = 2.0
GRACE = 2.0
CACHE_GIB = 0.01   # a small prefix cache, so it reaches its budget (and evicts) early in the run
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception)\b")
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "def quicksort(xs):\n", "# parse a CSV file\n",
           "async def fetch(url):", "def is_prime(n):\n    ", "SELECT name FROM"]
NO_THINK = {"enable_thinking": False}
CHATS = [[{"role": "user", "content": "Write a stack class."}],
         [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}],
         [{"role": "user", "content": "hi"}],
         [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Reverse a string."}]]
SHORT, MEDIUM = 16, 64
MODES = [None, "ar", "auto", "ddtree", "chain"]


# -- references: solo decodes, in-process, before the daemon starts ---------------------------------------------

def references(long_tokens: int) -> dict:
    """{("prompt", i) | ("chat", i): the first long_tokens greedy tokens' texts, by length}."""
    from dflash27b import Decoder
    refs = {}
    with Decoder(ctx=CTX, threads=1) as d:
        for i, p in enumerate(PROMPTS):
            refs[("prompt", i)] = _texts(d, d.generate(p, long_tokens, ignore_eos=True, cache=False).tokens)
        for i, msgs in enumerate(CHATS):
            system_msgs = [{**m, "role": "system"} if m["role"] == "developer" else m for m in msgs]
            ids = d.generate(d.chat_prompt(system_msgs, **NO_THINK), long_tokens, ignore_eos=True, cache=False).tokens
            refs[("chat", i)] = _texts(d, ids)
    return refs


def _texts(d, ids: list[int]) -> list[str]:
    """texts[n] = the text of the first n tokens."""
    return [d.detokenize(ids[:n]) for n in range(len(ids) + 1)]


# -- the daemon ---------------------------------------------------------------------------------------------------

def start_daemon(tmp: str, port: int, threads: int) -> tuple[subprocess.Popen, str, Path]:
    sock = os.path.join(tmp, "soak.sock")
    err = Path(tmp) / "daemon.log"
    cmd = [sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, "--http", f"127.0.0.1:{port}",
           "-c", str(CTX), "-t", str(threads), "--cache-mem", str(CACHE_GIB), "--max-body", str(MAX_BODY),
           "--read-timeout", str(READ_TIMEOUT), "--shutdown-grace", str(GRACE)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(err, "wb"),
                            env={**os.environ, "DFLASH27B_API_KEY": API_KEY})
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if proc.poll() is not None:
            sys.exit(f"daemon exited: {err.read_text()}")
        try:
            if sock_request(sock, {"op": "health"})["event"] == "health":
                return proc, sock, err
        except OSError:
            time.sleep(0.05)
    sys.exit("daemon did not start")


def sock_request(path: str, req: dict, timeout: float = 30) -> dict:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        for line in s.makefile("rb"):
            ev = json.loads(line)
            if ev["event"] in ("done", "error", "health", "shutdown"):
                return ev
        raise OSError("closed")
    finally:
        s.close()


def rss_and_fds(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


# -- the /health prober (its own process, so the load generator's work does not delay it) ----------------------------

def probe_health(port: int, seconds: float, out: mp.Queue) -> None:
    import httpx
    lat, fails, slow = [], 0, []
    t_start = time.monotonic()
    t_end = t_start + seconds
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
        while time.monotonic() < t_end and len(lat) < 100000:
            t0 = time.perf_counter()
            try:
                ok = c.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            lat.append(time.perf_counter() - t0)
            if lat[-1] > 0.05 and len(slow) < 100:
                slow.append((round(time.monotonic() - t_start, 1), round(lat[-1] * 1e3, 1)))
            fails += not ok
            time.sleep(0.05)
    out.put({"n": len(lat), "failed": fails, "max_ms": max(lat) * 1e3 if lat else None,
             "p99_ms": sorted(lat)[int(len(lat) * 0.99)] * 1e3 if lat else None,
             "median_ms": sorted(lat)[len(lat) // 2] * 1e3 if lat else None,
             "over_100ms": sum(x > 0.1 for x in lat), "over_50ms_at_s_ms": slow})


# -- clients ----------------------------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.count = Counter()
        self.failures: list[dict] = []
        self.exact = 0
        self.clear_4xx = 0
        self.timeouts = Counter()

    def ok(self, kind: str) -> None:
        self.count[kind, "ok"] += 1

    def fail(self, kind: str, why: str, **detail) -> None:
        self.count[kind, "fail"] += 1
        if len(self.failures) < 50:
            self.failures.append({"kind": kind, "why": why, **{k: str(v)[:300] for k, v in detail.items()}})


def _body(rng: random.Random, refs: dict, n: int, long: bool = False) -> tuple[dict, str, tuple]:
    """A well-formed request body, its endpoint, and its reference key."""
    extra = {"ignore_eos": True, "temperature": 0, "max_tokens": n}
    if (m := rng.choice(MODES)) is not None:
        extra["mode"] = m
    if rng.random() < 0.3:
        extra["cache_prompt"] = False
    if rng.random() < 0.5:   # (thinking off: the reply is all content, which the references are)
        i = rng.randrange(len(CHATS))
        return {"messages": CHATS[i], "chat_template_kwargs": NO_THINK, **extra}, "/v1/chat/completions", ("chat", i)
    i = rng.randrange(len(PROMPTS))
    return {"prompt": PROMPTS[i], **extra}, "/v1/completions", ("prompt", i)


def _text_of(j: dict) -> str:
    c = j["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


async def do_stream(c, rng, refs, t: Tally):
    body, path, key = _body(rng, refs, rng.choice([SHORT, MEDIUM]))
    parts, finish, done = [], None, False
    async with c.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return t.fail("stream", "status", status=r.status_code, body=await r.aread())
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                return t.fail("stream", "error object", ev=ev)
            ch = ev["choices"][0]
            parts.append(ch.get("text") or ch.get("delta", {}).get("content") or "")
            finish = ch.get("finish_reason") or finish
    want = refs[key][body["max_tokens"]]
    if not done or finish != "length" or "".join(parts) != want:
        return t.fail("stream", "not exact", got="".join(parts), want=want, finish=finish, done=done)
    t.exact += 1
    t.ok("stream")


async def do_plain(c, rng, refs, t: Tally):
    body, path, key = _body(rng, refs, rng.choice([SHORT, MEDIUM]))
    r = await c.post(path, json=body)
    if r.status_code != 200:
        return t.fail("plain", "status", status=r.status_code, body=r.text)
    got, want = _text_of(r.json()), refs[key][body["max_tokens"]]
    if got != want or r.json()["usage"]["completion_tokens"] != body["max_tokens"]:
        return t.fail("plain", "not exact", got=got, want=want)
    t.exact += 1
    t.ok("plain")


async def do_socket(sock: str, rng, refs, t: Tally):
    body, _, key = _body(rng, refs, rng.choice([SHORT, MEDIUM]))
    req = {"max_new_tokens": body.pop("max_tokens"), "stream": rng.random() < 0.5, "ignore_eos": True}
    req.update({k: v for k, v in body.items() if k in ("mode", "cache_prompt", "prompt", "messages",
                                                         "chat_template_kwargs")})
    reader, writer = await asyncio.open_unix_connection(sock)
    try:
        writer.write(json.dumps(req).encode() + b"\n")
        await writer.drain()
        pieces = []
        while line := await reader.readline():
            ev = json.loads(line)
            if ev["event"] == "token":
                pieces.append(ev["text"])
            elif ev["event"] in ("done", "error"):
                break
    finally:
        writer.close()
    want = refs[key][req["max_new_tokens"]]
    if ev["event"] != "done" or ev["text"] != want or (req["stream"] and "".join(pieces) != want):
        return t.fail("socket", "not exact", ev=ev, want=want)
    t.exact += 1
    t.ok("socket")


async def do_cancel(c, sock: str, rng, refs, t: Tally, long_tokens: int):
    body, path, _ = _body(rng, refs, long_tokens)
    how = rng.choice(["stream", "plain", "socket"])
    if how == "stream":
        async with c.stream("POST", path, json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"text": "' in line or '"content": "' in line:
                    break   # leave after the first content: the response closes with its connection
    elif how == "plain":
        import httpx
        try:
            await c.post(path, json=body, timeout=httpx.Timeout(30, read=0.2))
        except httpx.ReadTimeout:
            pass
    else:
        reader, writer = await asyncio.open_unix_connection(sock)
        writer.write(json.dumps({"prompt": PROMPTS[0], "max_new_tokens": long_tokens, "ignore_eos": True}).encode()
                     + b"\n")
        await writer.drain()
        try:
            await asyncio.wait_for(reader.readline(), 0.2)
        except asyncio.TimeoutError:
            pass
        writer.close()
    t.ok("cancel")


async def do_timeout(c, rng, refs, t: Tally, long_tokens: int):
    body, path, key = _body(rng, refs, long_tokens)
    r = await c.post(path, json={**body, "timeout": round(rng.uniform(0.3, 4.0), 2)})
    if r.status_code == 503 and "timed out" in r.json()["error"]["message"]:
        t.timeouts["in queue"] += 1
        return t.ok("timeout")
    if r.status_code != 200:
        return t.fail("timeout", "status", status=r.status_code, body=r.text)
    j = r.json()
    n, got = j["usage"]["completion_tokens"], _text_of(j)
    if got != refs[key][n] or j["dflash27b"]["stop_reason"] not in ("timeout", "length"):
        return t.fail("timeout", "not a prefix of the solo decode", got=got, n=n)
    t.timeouts[j["dflash27b"]["stop_reason"]] += 1
    t.exact += 1
    t.ok("timeout")


def _malformed_cases() -> list[tuple[str, dict, bytes | None, dict | None, int]]:
    """(name, headers, raw body or None, json body or None, expected status)."""
    ok_h = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    chat = "/v1/chat/completions"
    return [
        ("bad json", ok_h, b'{"prompt": ', None, 400),
        ("deep", ok_h, b"[" * 5000 + b"]" * 5000, None, 400),
        ("4300 digits", ok_h, b'{"prompt": "x", "max_tokens": ' + b"9" * 4300 + b"}", None, 400),
        ("surrogate", ok_h, b'{"prompt": "\\ud800"}', None, 400),
        ("stream string", ok_h, None, {"prompt": "x", "stream": "false"}, 400),
        ("unknown field", ok_h, None, {"prompt": "x", "frobnicate": 1}, 400),
        ("image part", ok_h, None, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}], "_path": chat}, 400),
        ("name", ok_h, None, {"messages": [{"role": "user", "content": "x", "name": "n"}], "_path": chat}, 400),
        ("int overflow", ok_h, None, {"prompt": "x", "max_tokens": 2**40}, 400),
        ("past the context", ok_h, None, {"prompt": "def f(x):\n    return x\n" * 2000}, 400),
        ("text/plain", {**ok_h, "Content-Type": "text/plain"}, b'{"prompt": "x"}', None, 415),
        ("no key", {"Authorization": "", "Content-Type": "application/json"}, None, {"prompt": "x"}, 401),
        ("wrong key", {**ok_h, "Authorization": "Bearer nope"}, None, {"prompt": "x"}, 401),
        ("foreign host", {**ok_h, "Host": "evil.example"}, None, {"prompt": "x"}, 403),
        ("oversized", ok_h, b'{"prompt": "' + b"a" * (MAX_BODY + 1000) + b'"}', None, 413),
    ]


async def do_malformed(c, rng, t: Tally):
    name, headers, raw, js, want = rng.choice(_malformed_cases())
    js = dict(js) if js else None
    path = js.pop("_path", "/v1/completions") if js else "/v1/completions"
    content = raw if raw is not None else json.dumps(js).encode()
    r = await c.post(path, content=content, headers=headers)
    msg = r.json().get("error", {}).get("message", "") if r.headers.get("content-type", "").startswith(
        "application/json") else ""
    if r.status_code != want or not msg or CLASS_NAME.search(msg):
        return t.fail("malformed", name, status=r.status_code, body=r.text[:300])
    t.clear_4xx += 1
    t.ok("malformed")


async def do_slow_headers(port: int, t: Tally):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(4096), READ_TIMEOUT + 2)
    except asyncio.TimeoutError:
        data = b""
    writer.close()
    if not data.startswith(b"HTTP/1.1 408"):
        return t.fail("slow headers", "no 408", got=data[:200])
    t.clear_4xx += 1
    t.ok("slow headers")


async def do_socket_malformed(sock: str, t: Tally):
    reader, writer = await asyncio.open_unix_connection(sock)
    try:
        writer.write(b"[" * 3000 + b"]" * 3000 + b'\n{"op": "health"}\n')
        await writer.drain()
        first = json.loads(await reader.readline())
        second = json.loads(await reader.readline())
    finally:
        writer.close()
    if first.get("code") != "bad_request" or second.get("event") != "health":
        return t.fail("socket malformed", "pipeline", first=first, second=second)
    t.clear_4xx += 1
    t.ok("socket malformed")


ACTIONS = [("stream", 26), ("plain", 20), ("socket", 10), ("cancel", 12), ("timeout", 8), ("malformed", 18),
           ("slow headers", 1), ("socket malformed", 5)]


async def client(k: int, port: int, sock: str, refs: dict, t_end: float, t: Tally, seed: int, long_tokens: int):
    import httpx
    rng = random.Random(seed * 1000 + k)
    names, weights = zip(*ACTIONS)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        for _ in range(1_000_000):
            if time.monotonic() >= t_end:
                return
            kind = rng.choices(names, weights)[0]
            try:
                await _act(kind, c, port, sock, rng, refs, t, long_tokens)
            except Exception as e:  # a transport failure is a failure of the run, recorded, not fatal
                t.fail(kind, "exception", exc=repr(e))


async def _act(kind, c, port, sock, rng, refs, t, long_tokens):
    if kind == "stream":
        await do_stream(c, rng, refs, t)
    elif kind == "plain":
        await do_plain(c, rng, refs, t)
    elif kind == "socket":
        await do_socket(sock, rng, refs, t)
    elif kind == "cancel":
        await do_cancel(c, sock, rng, refs, t, long_tokens)
    elif kind == "timeout":
        await do_timeout(c, rng, refs, t, long_tokens)
    elif kind == "malformed":
        await do_malformed(c, rng, t)
    elif kind == "slow headers":
        await do_slow_headers(port, t)
    else:
        await do_socket_malformed(sock, t)


# -- the run ---------------------------------------------------------------------------------------------------

async def load(a, port: int, sock: str, pid: int, refs: dict, t: Tally) -> dict:
    """Run the clients; sample the daemon's RSS and fds.  The RSS baseline is taken once the warm-up is over:
    at least min(60 s, 20% of the run) and the prefix cache at its budget (evicting), since a cache filling
    up to the size it was given is not growth."""
    t0 = time.monotonic()
    t_end = t0 + a.seconds
    warmup_min = t0 + min(60.0, a.seconds * 0.2)
    samples, baseline, warm_at = [], None, None
    tasks = [asyncio.create_task(client(k, port, sock, refs, t_end, t, a.seed, a.long_tokens))
             for k in range(a.clients)]
    while not all(x.done() for x in tasks):
        await asyncio.sleep(min(2.0, max(0.05, t_end - time.monotonic())))
        rss, fds = rss_and_fds(pid)
        samples.append((round(time.monotonic() - t0, 1), rss, fds))
        if baseline is None and time.monotonic() >= warmup_min and await _cache_full(sock):
            baseline, warm_at = rss, time.monotonic() - t0
        if time.monotonic() > t_end + 120:  # a client stuck past its deadline: stop waiting for it
            for x in tasks:
                x.cancel()
            break
    await asyncio.gather(*tasks, return_exceptions=True)
    final = rss_and_fds(pid)[0]
    at_min = next((r for ts, r, _ in samples if ts >= warmup_min - t0), None)
    return {"baseline_after_warmup_bytes": baseline, "final_bytes": final, "max_bytes": max(s[1] for s in samples),
            "growth_pct": round((final / baseline - 1) * 100, 2) if baseline else None,
            "warmup_ended_s": round(warm_at, 1) if warm_at is not None else None,
            "growth_pct_from_min_warmup": round((final / at_min - 1) * 100, 2) if at_min else None,
            "first_bytes": samples[0][1], "samples_s_rss_fds": samples[:: max(1, len(samples) // 60)]}


async def _cache_full(sock: str) -> bool:
    health = await asyncio.to_thread(sock_request, sock, {"op": "health"})
    return (health.get("cache") or {}).get("evicted", 0) > 0


def wait_fds(pid: int, want: int, seconds: float = 15) -> int:
    t_end = time.monotonic() + seconds
    fds = rss_and_fds(pid)[1]
    while fds > want and time.monotonic() < t_end:
        time.sleep(0.2)
        fds = rss_and_fds(pid)[1]
    return fds


def stop_daemon(proc: subprocess.Popen, sock: str) -> dict:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(GRACE + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    return {"exit_code": rc, "exit_s": round(time.monotonic() - t0, 3), "socket_removed": not os.path.exists(sock)}


def run(a) -> dict:
    t_refs = time.monotonic()
    refs = references(a.long_tokens)
    refs_s = time.monotonic() - t_refs
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        proc, sock, log = start_daemon(tmp, port, a.threads)
        try:
            fds_idle = rss_and_fds(proc.pid)[1]
            q: mp.Queue = mp.Queue()
            prober = mp.Process(target=probe_health, args=(port, a.seconds, q))
            prober.start()
            os.nice(5)  # the load generator yields to the daemon and the prober on a small machine
            t = Tally()
            rss = asyncio.run(load(a, port, sock, proc.pid, refs, t))
            health = q.get(timeout=60)
            prober.join(10)
            fds_end = wait_fds(proc.pid, fds_idle)
            counters = sock_request(sock, {"op": "health"})
        finally:
            shutdown = stop_daemon(proc, sock)
        log_text = log.read_text()
    return _record(a, t, rss, health, fds_idle, fds_end, counters, shutdown, log_text, refs_s)


def _record(a, t: Tally, rss, health, fds_idle, fds_end, counters, shutdown, log_text, refs_s) -> dict:
    kinds = sorted({k for k, _ in t.count})
    requests = {k: {"ok": t.count[k, "ok"], "fail": t.count[k, "fail"]} for k in kinds}
    cancelled = counters["cancelled"]
    checks = {
        "every well-formed reply exact": all(requests.get(k, {}).get("fail", 0) == 0
                                             for k in ("stream", "plain", "socket", "timeout")) and t.exact > 0,
        "every bad request a clear 4xx": all(requests.get(k, {}).get("fail", 0) == 0
                                             for k in ("malformed", "slow headers", "socket malformed")),
        "no transport failures": not t.failures,
        "rss growth < 5%": rss["growth_pct"] is not None and rss["growth_pct"] < 5,
        "fds back to baseline": fds_end <= fds_idle,
        "no decoding after a client left": counters["after_cancel"] == {"steps": 0, "tokens": 0}
                                           and cancelled["client_gone"] > 0,
        "/health < 100 ms throughout": health["failed"] == 0 and health["max_ms"] is not None
                                       and health["max_ms"] < 100,
        "clean SIGTERM": shutdown["exit_code"] == 0 and shutdown["socket_removed"]
                         and shutdown["exit_s"] < GRACE + 1,
        "no traceback in the daemon log": "Traceback" not in log_text,
    }
    return {"what": "bench/soak.py: the daemon (bundled tiny pair) under mixed, cancelled, timed-out, malformed "
                    "and oversized requests, loopback only",
            "machine": _machine(), "commit": _commit(), "clients": a.clients, "seconds": a.seconds,
            "threads": a.threads, "long_tokens": a.long_tokens, "seed": a.seed,
            "references_s": round(refs_s, 1), "requests": requests, "requests_total": sum(t.count.values()),
            "exact_replies": t.exact, "clear_4xx": t.clear_4xx, "timeouts": dict(t.timeouts),
            "health_probe": health, "rss": rss, "fds": {"idle_before": fds_idle, "idle_after": fds_end},
            "daemon": {k: counters[k] for k in ("served", "cancelled", "after_cancel", "cancel_latency_max_s",
                                                  "loop_lag_max_s", "cache")},
            "shutdown": shutdown, "failures": t.failures, "checks": checks, "pass": all(checks.values())}


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown"
    return f"{name}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--threads", type=int, default=1, help="the daemon's decode threads")
    ap.add_argument("--long-tokens", type=int, default=400, help="max_tokens of cancelled / timed-out requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak-cpu.json"))
    a = ap.parse_args()
    if not 1 <= a.clients <= 256 or not 1 <= a.seconds <= 3600:
        ap.error("--clients must be in 1..256 and --seconds in 1..3600")
    rec = run(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")
    s = rec
    print(f"{s['requests_total']} requests from {a.clients} clients in {a.seconds:g} s: {s['exact_replies']} exact "
          f"replies, {s['clear_4xx']} clear 4xx; /health max {s['health_probe']['max_ms']:.1f} ms "
          f"(p99 {s['health_probe']['p99_ms']:.1f}); RSS {s['rss']['growth_pct']:+.2f}% after warm-up; fds "
          f"{s['fds']['idle_before']} -> {s['fds']['idle_after']}; after cancel {s['daemon']['after_cancel']}; "
          f"exit {s['shutdown']['exit_s']} s")
    for name, ok in s["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    for f in s["failures"][:10]:
        print("  failure:", f)
    print(f"wrote {a.out}")
    return 0 if s["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
