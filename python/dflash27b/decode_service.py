"""The decode service: one worker thread owns the Decoder and serves jobs in arrival order; a job ends early
when its client goes away, its deadline passes or the daemon shuts down (`Job.cancel` drops a waiting job at
once, the worker checks a running one before every decode step and after every prefill chunk), and the
counters prove that no step starts after its job was cancelled.  The socket server and the HTTP front submit
to it; neither is imported here."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ._lib import DFlashError
from .decoder import Decoder

from .serve_protocol import (THINK_OPEN, BAD_REQUEST, CANCEL_REASONS, CLIENT_GONE, INTERNAL, PromptTokenizer, PromptTooLong, RequestError, SHUTDOWN, StopMatcher, TIMEOUT, chat_text, event_error, too_long)

# -- jobs ----------------------------------------------------------------------------------------------------

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class Job:
    """One queued request.  `emit` may be called from any thread and hands events to the loop."""

    def __init__(self, params: dict, loop: asyncio.AbstractEventLoop, service: "DecodeService",
                 timeout: float | None, arrived: float | None = None):
        self.params = params
        self.loop = loop
        self.service = service
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.reason: str | None = None
        self.cancel_time: float | None = None    # monotonic, set just after the flag
        self.state = WAITING
        self.timeout = timeout
        self.arrived = time.monotonic() if arrived is None else arrived
        self.deadline = self.arrived + timeout if timeout else None
        self.timer: asyncio.TimerHandle | None = None   # the deadline on the loop, for a waiting job

    def finished(self) -> None:
        """Called once it ended: drop the deadline timer (it would keep the job alive until it fires)."""
        if self.timer is not None:
            try:
                self.loop.call_soon_threadsafe(self.timer.cancel)
            except RuntimeError:  # the loop is closed: nothing left to fire
                pass

    def emit(self, event: dict | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self, reason: str = CLIENT_GONE) -> bool:
        """End this request early (first reason wins; a finished one is left alone).  Thread-safe."""
        return self.service.cancel(self, reason)

    def stop_requested(self) -> bool:
        """Checked by the worker before every step: cancelled, or past the deadline (which cancels it)."""
        if not self.cancelled.is_set() and self.deadline is not None and time.monotonic() >= self.deadline:
            self.cancel(TIMEOUT)
        return self.cancelled.is_set()


@dataclass
class CancelStats:
    """What cancellation cost.  `steps_after` / `tokens_after` count decode steps that *started* after their
    job's cancel flag was set (the flag is checked before every step, so they stay 0)."""
    by_reason: dict = field(default_factory=lambda: {r: 0 for r in CANCEL_REASONS})
    steps_after: int = 0
    tokens_after: int = 0
    latency_max_s: float = 0.0   # cancel -> the worker let go of the job (running jobs; waiting ones: 0)




class DecodeService:
    """Owns the decoder; runs queued jobs one at a time on a worker thread."""

    def __init__(self, decoder: Decoder, request_timeout: float = 0.0, log: Callable[[str], None] = lambda m: None):
        self.decoder = decoder
        self.request_timeout = request_timeout
        self.log = log
        self.prompts = PromptTokenizer(decoder.tokenizer)
        self.n_vocab = decoder.info["n_vocab"]
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self.running: Job | None = None
        self.accepting = True
        self.served = 0
        self.started = time.time()
        self.cancel_stats = CancelStats()
        # totals for /metrics (written by the worker thread only)
        self.prompt_tokens_total = 0
        self.prefilled_tokens_total = 0     # prompt tokens actually run (not restored from the prefix cache)
        self.prefill_seconds_total = 0.0
        self.cached_tokens_total = 0
        self.generated_tokens_total = 0
        self.decode_steps_total = 0
        self.decode_seconds_total = 0.0
        self._worker = threading.Thread(target=self._run, name="dflash27b-decode", daemon=True)
        self._worker.start()

    # -- loop side ---------------------------------------------------------------------------------------
    def prepare(self, params: dict) -> dict:
        """The request with its prompt as token ids (chat rendered, text tokenized), checked against the
        context before it queues.  Blocking: run it off the event loop."""
        n_ctx = self.decoder.n_ctx
        p = {k: v for k, v in params.items() if k not in ("prompt", "messages")}
        if "prompt_ids" in params:
            ids = params["prompt_ids"]
            if len(ids) >= n_ctx:
                raise too_long(str(len(ids)), n_ctx)
            n_vocab = self.n_vocab
            bad = next((t for t in ids if t >= n_vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad} is outside the vocabulary (0..{n_vocab - 1})")
            return p
        if "messages" in params:
            text = chat_text(self.decoder, params["messages"], params.get("chat_template_kwargs"),
                             params["params"].tools)
            p["think_open"] = text.rstrip().endswith(THINK_OPEN)   # the template opened the reply's thinking
        else:
            text = params["prompt"]
        try:
            p["prompt_ids"] = self.prompts.encode(text, limit=n_ctx - 1)
        except PromptTooLong as e:
            raise too_long(str(e), n_ctx) from None
        if "messages" in params and self.decoder.prefix_cache is not None:   # a checkpoint where the history ends
            p["history"] = self.decoder.history_len(params["messages"], p["prompt_ids"], params["params"].tools,
                                                    params.get("chat_template_kwargs"))
        if not p["prompt_ids"]:
            raise RequestError("empty prompt: give at least one token")
        return p

    def timeout_for(self, params: dict) -> float | None:
        """The request's own `timeout`, capped by the server's --request-timeout (0 = none)."""
        mine, cap = params.get("timeout"), self.request_timeout or None
        return min(x for x in (mine, cap) if x) if (mine or cap) else None

    def submit(self, params: dict, loop: asyncio.AbstractEventLoop, arrived: float | None = None) -> tuple[Job, int]:
        """Queue a prepared request (from the loop); returns the job and how many requests are ahead of it.
        `arrived`: when the request came in (monotonic), where its deadline counts from."""
        timeout = self.timeout_for(params)
        job = Job(params, loop, self, timeout, arrived)
        with self._lock:
            if not self.accepting:
                raise RequestError("the daemon is shutting down and takes no new requests", SHUTDOWN)
            ahead = len(self._waiting) + (self.running is not None)
            self._waiting.append(job)
        if job.deadline is not None:  # a waiting job times out at its deadline, not when it reaches the worker
            job.timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), job.cancel, TIMEOUT)
        self._queue.put(job)
        return job, ahead

    def queue_length(self) -> int:
        with self._lock:
            return len(self._waiting) + (self.running is not None)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return int(self.running is not None), len(self._waiting)

    def cancel(self, job: Job, reason: str) -> bool:
        with self._lock:
            if job.state == FINISHED or job.cancelled.is_set():
                return False
            job.reason = reason
            job.cancelled.set()
            job.cancel_time = time.monotonic()   # after the flag: a step decided before this saw no flag
            self.cancel_stats.by_reason[reason] += 1
            dropped = job.state == WAITING
            if dropped:  # never started: gone from the queue now, so health and positions stop counting it
                self._waiting.remove(job)
                job.state = FINISHED
        if dropped:
            job.finished()
            job.emit(self._unstarted_end(job))
            job.emit(None)
        return True

    def cancel_waiting(self, reason: str) -> None:
        with self._lock:
            waiting = list(self._waiting)
        for j in waiting:
            j.cancel(reason)

    def stop_accepting(self) -> None:
        with self._lock:
            self.accepting = False

    def close(self, timeout: float = 5.0) -> None:
        self.stop_accepting()
        self.cancel_waiting(SHUTDOWN)
        running = self.running
        if running is not None:
            running.cancel(SHUTDOWN)
        self._queue.put(None)
        self._worker.join(timeout=timeout)

    # -- worker side ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != WAITING:   # dropped while it waited
                    continue
                self._waiting.remove(job)
                job.state = RUNNING
                self.running = job
            end = self._serve(job)
            with self._lock:  # finished before the client can read its end: health never counts it
                job.state = FINISHED
                self.running = None
                self.served += 1
            job.finished()
            job.emit(end)
            job.emit(None)

    def _serve(self, job: Job) -> dict:
        """Run one job; returns its terminal event."""
        try:
            job.emit({"event": "start"})
            return self._decode(job)
        except DFlashError as e:
            if job.cancelled.is_set():  # e.g. "prefill cancelled": say why it was cancelled instead
                return self._early_end(job, None)
            return event_error(str(e), getattr(e, "code", BAD_REQUEST))
        except Exception:  # a bug: the log gets the traceback, the client a plain message; keep serving
            self.log("internal error while decoding:\n" + traceback.format_exc().rstrip())
            return event_error("internal error while decoding (the daemon's log has the details)", INTERNAL)

    def _unstarted_end(self, job: Job) -> dict:
        if job.reason == TIMEOUT:
            return event_error(f"timed out after {job.timeout:g} s waiting in the queue (timeout)", TIMEOUT)
        if job.reason == SHUTDOWN:
            return event_error("the daemon is shutting down: the request was not started", SHUTDOWN)
        return event_error("cancelled: the client went away", CLIENT_GONE)

    def _early_end(self, job: Job, done: dict | None) -> dict:
        """The terminal event of a job stopped before its end.  `done`: what it decoded (None: in prefill)."""
        self.cancel_stats.latency_max_s = max(self.cancel_stats.latency_max_s, time.monotonic() - job.cancel_time)
        n = len(done["tokens"]) if done else 0
        if job.reason == TIMEOUT:
            if done is None:
                return event_error(f"timed out after {job.timeout:g} s during the prompt's prefill (timeout)",
                                    TIMEOUT)
            done["stats"]["stop_reason"] = "timeout"
            return done
        if job.reason == SHUTDOWN:
            return event_error(f"the daemon is shutting down: the request was stopped after {n} tokens",
                                SHUTDOWN)
        return event_error("cancelled: the client went away", CLIENT_GONE)

    def _count_after_cancel(self, job: Job, decided: float, n_tokens: int) -> None:
        if job.cancel_time is not None and job.cancel_time < decided:
            self.cancel_stats.steps_after += 1
            self.cancel_stats.tokens_after += n_tokens

    def _decode(self, job: Job) -> dict:
        p, dec = job.params, self.decoder
        stream, stop = p["stream"], StopMatcher(p["stop"])
        sd = dec.tokenizer.stream_decoder()
        tokens: list[int] = []
        stopped = cancelled = False
        want_lp = p["params"].logprobs is not None
        steps = dec.stream_ids(p["prompt_ids"], params=p["params"], cache=p.get("cache_prompt", True),
                               on_prefill=lambda done, total: job.stop_requested(), history=p.get("history"))
        try:
            while True:
                decided = time.monotonic()
                if job.stop_requested():
                    cancelled = True
                    break
                toks = next(steps, None)
                if toks is None:
                    break
                self._count_after_cancel(job, decided, len(toks))
                tokens += toks
                piece, stopped = stop.push("".join(sd.push(t) for t in toks))
                if stream:
                    ev = {"event": "token", "ids": toks, "text": piece}
                    if want_lp:
                        ev["logprobs"] = dec.last_logprobs(len(tokens) - len(toks))
                    job.emit(ev)
                if stopped:
                    break
        finally:
            steps.close()
        stats = self._account(dec.last_stats().to_dict())
        if cancelled and job.reason != TIMEOUT:
            return self._early_end(job, {"tokens": tokens})
        if not stopped:
            piece, stopped = stop.push(sd.flush())
            piece += "" if stopped else stop.flush()
            if stream and piece:
                job.emit({"event": "token", "ids": [], "text": piece})
        if stopped:
            stats["stop_reason"] = "stop"
        done = {"event": "done", "tokens": tokens, "text": stop.text, "stats": stats}
        if "think_open" in p:   # a chat request: the reply as an assistant message (reasoning, tool calls)
            done["message"] = dec.reply_message(stop.text, p["params"])
        if want_lp:
            done["logprobs"] = dec.last_logprobs()[:len(tokens)]
        return self._early_end(job, done) if cancelled else done

    def _account(self, stats: dict) -> dict:
        """Add a decode's stats to the totals /metrics reports."""
        self.prompt_tokens_total += stats["prompt_tokens"]
        self.prefilled_tokens_total += stats["prompt_tokens"] - stats["cached_tokens"]
        self.prefill_seconds_total += stats["prefill_s"]
        self.cached_tokens_total += stats["cached_tokens"]
        self.generated_tokens_total += stats["generated_tokens"]
        self.decode_steps_total += stats["steps"]
        self.decode_seconds_total += stats["decode_s"]
        return stats
