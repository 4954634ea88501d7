"""OpenAI-compatible HTTP front of the daemon (`dflash27b serve --http HOST:PORT`), on Starlette + uvicorn.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE streaming with
`data: [DONE]`), GET /health.  Requests go through the daemon's one decode queue, like socket requests.
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

_EXTRA = ("mode", "budget", "topk", "block_size", "chain_seed", "top_k", "min_p", "ignore_eos", "cache_prompt")


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _to_engine(body: dict, chat: bool) -> dict:
    """OpenAI request body -> a daemon generate request (validated by parse_generate)."""
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
        params["stream"] = True  # always stream internally; the HTTP shape decides what is sent
        job, _ = service.submit(params, asyncio.get_running_loop())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created, model = int(time.time()), daemon.model_name
        kind = "chat.completion" if chat else "text_completion"

        def usage(stats):
            return {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["generated_tokens"],
                    "total_tokens": stats["prompt_tokens"] + stats["generated_tokens"],
                    "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
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
                    if ev["event"] == "token" and ev["text"]:
                        yield chunk(ev["text"], None)
                    elif ev["event"] == "done":
                        yield chunk(None if chat else "", _finish(ev["stats"]["stop_reason"]))
                    elif ev["event"] == "error":
                        yield "data: " + json.dumps({"error": {"message": ev["message"], "type": "server_error"}}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        async for ev in events():
            if ev["event"] == "error":
                return _error(400, ev["message"])
            if ev["event"] == "done":
                fin = _finish(ev["stats"]["stop_reason"])
                choice = ({"index": 0, "message": {"role": "assistant", "content": ev["text"]}, "finish_reason": fin}
                          if chat else {"index": 0, "text": ev["text"], "finish_reason": fin, "logprobs": None})
                return JSONResponse({"id": rid, "object": kind, "created": created, "model": model,
                                     "choices": [choice], "usage": usage(ev["stats"]),
                                     "dflash27b": {k: ev["stats"][k] for k in ("mode", "mean_accept", "decode_tok_s")}})
        return _error(500, "the request ended without a result", "server_error")

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the daemon owns SIGINT/SIGTERM and stops this server itself


def make_http_server(daemon, host: str, port: int) -> "uvicorn.Server":
    config = uvicorn.Config(make_app(daemon), host=host, port=port, log_level="warning", lifespan="off")
    return _Server(config)
