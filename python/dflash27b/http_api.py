"""OpenAI-compatible HTTP front of the daemon (`dflash27b serve --http HOST:PORT`), on Starlette + uvicorn.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming with
`data: [DONE]`), GET /health, POST /tokenize, POST /detokenize, GET /metrics (Prometheus text), as
llama-server offers them.  Every OpenAI request field is honoured, a no-op where it cannot change the answer,
or refused with 400 naming it.  Requests go through the daemon's one decode queue, like socket requests.
OpenAI's sampling fields map onto the engine's; `mode`, `budget`, `top_k`, `min_p`, `ignore_eos` may be
passed as extra body fields (openai client: `extra_body={...}`).  Chat prompts use the GGUF's template.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from ._lib import DFlashError
from .server import parse_generate

try:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    import uvicorn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise DFlashError("the HTTP front needs starlette and uvicorn: pip install 'dflash27b[serve]'") from e

_EXTRA = ("mode", "budget", "topk", "block_size", "chain_seed", "expand", "top_k", "min_p", "ignore_eos",
          "cache_prompt", "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty")

# Every OpenAI request field is honoured, accepted as a no-op where it cannot change the answer, or refused
# with HTTP 400 naming it (docs/PROTOCOL.md has the table).  Unknown fields are refused too.
_HONOURED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
             "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs"} | set(_EXTRA)
_NO_OP = {"user", "metadata", "store", "service_tier", "modalities", "parallel_tool_calls"}


def _neutral(k: str, v) -> bool:
    """Values of the not-yet-honoured fields that ask for nothing (so the answer cannot change)."""
    if v is None:
        return True
    return {
        "logit_bias": v == {},
        "response_format": isinstance(v, dict) and v.get("type") == "text" and len(v) == 1,
        "tools": v == [],
        "tool_choice": v == "none",
        "functions": v == [],
        "function_call": v == "none",
        "echo": v is False,
        "suffix": v == "",
        "best_of": v == 1,
    }.get(k, False)


_WHY = {"logit_bias": "logit biases are not applied",
        "response_format": "constrained output (JSON mode / schema) is not supported; only {\"type\": \"text\"}",
        "tools": "tool calls are not supported", "tool_choice": "tool calls are not supported",
        "functions": "function calls are not supported", "function_call": "function calls are not supported",
        "echo": "echo is not supported", "suffix": "suffix (insertion) is not supported",
        "best_of": "only best_of=1 is supported"}


def _check_fields(body: dict) -> None:
    for k, v in body.items():
        if k in _HONOURED or k in _NO_OP:
            continue
        if k in _WHY:
            if not _neutral(k, v):
                raise DFlashError(f"'{k}' is not supported: {_WHY[k]}")
            continue
        raise DFlashError(f"unknown request field '{k}'")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"} or
                           not isinstance(so.get("include_usage", False), bool)):
        raise DFlashError("'stream_options' takes only {\"include_usage\": true|false}")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _to_engine(body: dict, chat: bool) -> dict:
    """OpenAI request body -> a daemon generate request (validated by parse_generate)."""
    _check_fields(body)
    req: dict = {}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise DFlashError("'messages' must be a list of {role, content}")
        norm = []
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):  # content parts: keep the text ones
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
            norm.append({"role": m.get("role") if isinstance(m, dict) else None, "content": c})
        req["messages"] = norm
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            req["prompt_ids"] = p
        elif isinstance(p, str):
            req["prompt"] = p
        else:
            raise DFlashError("'prompt' must be a string or a list of token ids (one prompt per request)")
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:  # logprobs: bool, top_logprobs: 0..20 alternatives
        if lp is not None and not isinstance(lp, bool):
            raise DFlashError("'logprobs' must be true or false")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
            raise DFlashError("'top_logprobs' must be an integer in 0..20")
        if top and not lp:
            raise DFlashError("'top_logprobs' needs 'logprobs': true")
        if lp:
            req["logprobs"] = top or 0
    else:  # completions: logprobs = the number of alternatives (0..20)
        if top is not None:
            raise DFlashError("'top_logprobs' is a chat field; completions take 'logprobs': k")
        if lp is not None:
            if not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20:
                raise DFlashError("'logprobs' must be an integer in 0..20")
            req["logprobs"] = lp
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    if n is not None:
        req["max_new_tokens"] = n
    if body.get("n", 1) != 1:
        raise DFlashError("only n=1 is supported")
    # OpenAI's default temperature is 1.0 (sampling); pass temperature=0 for greedy, exact decoding
    req["temperature"] = 1.0 if body.get("temperature") is None else body["temperature"]
    for k in ("top_p", "seed", "stop"):
        if body.get(k) is not None:
            req[k] = body[k]
    for k in _EXTRA:
        if k in body:
            req[k] = body[k]
    req["stream"] = bool(body.get("stream", False))
    return parse_generate(req)


def _finish(stop_reason: str) -> str:
    return "length" if stop_reason in ("length", "context_full") else "stop"


def make_app(daemon) -> Starlette:
    service = daemon.service

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": daemon.model_name, "object": "model", "created": int(service.started), "owned_by": "dflash27b",
            "meta": {"target": daemon.decoder.target, "draft": daemon.decoder.draft, "n_ctx": daemon.decoder.n_ctx}}]})

    async def health(_: Request):
        return JSONResponse(daemon.health())

    async def completion(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"malformed JSON body: {e}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            params = _to_engine(body, chat)
        except DFlashError as e:
            return _error(400, str(e))
        stream = params["stream"]
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        params["stream"] = True  # always stream internally; the HTTP shape decides what is sent
        job, _ = service.submit(params, asyncio.get_running_loop())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created, model = int(time.time()), daemon.model_name
        kind = "chat.completion" if chat else "text_completion"

        def usage(stats):
            return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
                    "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"],
                    "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}}

        dec = daemon.decoder

        def piece(t: int) -> dict:
            text = dec.detokenize([t])
            return {"token": text, "bytes": list(text.encode("utf-8"))}

        def logprobs_of(lps: list[dict] | None):
            """OpenAI's shape: chat {"content": [...]}, completions {"tokens", "token_logprobs", ...}."""
            if lps is None:
                return None
            if chat:
                return {"content": [{**piece(e["token"]), "logprob": e["logprob"],
                                     "top_logprobs": [{**piece(i), "logprob": p} for i, p in e["top"]]} for e in lps]}
            toks = [piece(e["token"])["token"] for e in lps]
            offs, o = [], 0
            for t in toks:
                offs.append(o)
                o += len(t)
            return {"tokens": toks, "token_logprobs": [e["logprob"] for e in lps],
                    "top_logprobs": [{piece(i)["token"]: p for i, p in e["top"]} for e in lps], "text_offset": offs}

        def chunk(text: str | None, finish: str | None, first: bool = False, lps: list[dict] | None = None) -> str:
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs_of(lps)}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs_of(lps)}
            return "data: " + json.dumps({"id": rid, "object": kind + ".chunk" if chat else kind,
                                          "created": created, "model": model, "choices": [choice]}) + "\n\n"

        async def events():
            try:
                while True:
                    ev = await job.events.get()
                    if ev is None:
                        return
                    yield ev
            finally:
                job.cancel()  # no-op when finished; frees the slot when the HTTP client went away

        if stream:
            async def sse():
                if chat:
                    yield chunk(None, None, first=True)
                async for ev in events():
                    if ev["event"] == "token" and (ev["text"] or ev.get("logprobs")):
                        yield chunk(ev["text"], None, lps=ev.get("logprobs"))
                    elif ev["event"] == "done":
                        yield chunk(None if chat else "", _finish(ev["stats"]["stop_reason"]))
                        if include_usage:  # OpenAI's shape: one more chunk, no choices, the usage
                            yield "data: " + json.dumps({"id": rid, "object": kind + ".chunk" if chat else kind,
                                                         "created": created, "model": model, "choices": [],
                                                         "usage": usage(ev["stats"])}) + "\n\n"
                    elif ev["event"] == "error":
                        yield "data: " + json.dumps({"error": {"message": ev["message"], "type": "server_error"}}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        async for ev in events():
            if ev["event"] == "error":
                return _error(400, ev["message"])
            if ev["event"] == "done":
                fin = _finish(ev["stats"]["stop_reason"])
                lps = logprobs_of(ev.get("logprobs"))
                choice = ({"index": 0, "message": {"role": "assistant", "content": ev["text"]}, "finish_reason": fin,
                           "logprobs": lps}
                          if chat else {"index": 0, "text": ev["text"], "finish_reason": fin, "logprobs": lps})
                return JSONResponse({"id": rid, "object": kind, "created": created, "model": model,
                                     "choices": [choice], "usage": usage(ev["stats"]),
                                     "dflash27b": {k: ev["stats"][k] for k in ("mode", "mean_accept", "decode_tok_s")}})
        return _error(500, "the request ended without a result", "server_error")

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DFlashError(f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise DFlashError("the request body must be a JSON object")
        return body

    async def tokenize(request: Request):
        """llama-server's /tokenize: {"content", "add_special"?, "parse_special"?, "with_pieces"?}."""
        try:
            body = await body_of(request)
            unknown = set(body) - {"content", "add_special", "parse_special", "with_pieces"}
            if unknown:
                raise DFlashError(f"unknown request field '{sorted(unknown)[0]}'")
            if not isinstance(body.get("content"), str):
                raise DFlashError("'content' must be a string")
            if body.get("add_special"):
                raise DFlashError("'add_special' is not supported: Qwen3.5's tokenizer adds no BOS token")
            ids = daemon.decoder.tokenize(body["content"], parse_special=bool(body.get("parse_special", True)))
        except DFlashError as e:
            return _error(400, str(e))
        if body.get("with_pieces"):
            return JSONResponse({"tokens": [{"id": t, "piece": daemon.decoder.detokenize([t])} for t in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request):
        try:
            body = await body_of(request)
            toks = body.get("tokens")
            n_vocab = daemon.decoder.info["n_vocab"]
            if set(body) - {"tokens"} or not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab for t in toks):
                raise DFlashError(f"the body must be {{\"tokens\": [ids in 0..{n_vocab - 1}]}}")
        except DFlashError as e:
            return _error(400, str(e))
        return JSONResponse({"content": daemon.decoder.detokenize(toks)})

    async def metrics(_: Request):
        """Prometheus text exposition: requests, tokens, accept length, queue, cache."""
        from starlette.responses import PlainTextResponse
        h = daemon.health()
        cache = h.get("cache") or {}
        steps = service.decode_steps_total
        rows = [
            ("requests_total", "counter", "generate requests served", service.served),
            ("prompt_tokens_total", "counter", "prompt tokens of served requests", service.prompt_tokens_total),
            ("prompt_tokens_cached_total", "counter", "prompt tokens restored from the prefix cache",
             service.cached_tokens_total),
            ("tokens_predicted_total", "counter", "tokens generated", service.generated_tokens_total),
            ("decode_steps_total", "counter", "decode steps (target forwards after prefill)", steps),
            ("decode_seconds_total", "counter", "seconds spent decoding", round(service.decode_seconds_total, 6)),
            ("mean_accept_length", "gauge", "tokens per decode step, all requests (bonus included)",
             round((service.generated_tokens_total - service.served) / steps, 4) if steps else 0),
            ("queue_length", "gauge", "requests running or waiting", h["queue"]),
            ("prefix_cache_bytes", "gauge", "bytes held by the prefix cache", cache.get("bytes", 0)),
            ("prefix_cache_checkpoints", "gauge", "prefix cache checkpoints", cache.get("checkpoints", 0)),
            ("prefix_cache_hits_total", "counter", "requests that reused a cached prefix", cache.get("hits", 0)),
            ("resident_memory_bytes", "gauge", "daemon resident set size", h["rss_bytes"]),
        ]
        text = "".join(f"# HELP dflash27b_{n} {d}\n# TYPE dflash27b_{n} {t}\ndflash27b_{n} {v}\n" for n, t, d, v in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the daemon owns SIGINT/SIGTERM and stops this server itself


def make_http_server(daemon, host: str, port: int) -> "uvicorn.Server":
    config = uvicorn.Config(make_app(daemon), host=host, port=port, log_level="warning", lifespan="off")
    return _Server(config)
