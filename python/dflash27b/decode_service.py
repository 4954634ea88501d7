"""The decode service: one worker thread owns the Decoder and serves jobs in arrival order in `parallel` slots
(each a context of its own on the decoder's backend: Decoder._slot): every step of the running jobs is one
batched target forward (dfl_generate_next_many), a waiting job takes the first slot that frees, and each
reply is exactly what the job would get alone.  A job ends early when its client goes away, its deadline
passes or the daemon shuts down (`Job.cancel` drops a waiting job at once, the worker checks a running one
before every decode step and after every prefill chunk), and the counters prove that no step starts after
its job was cancelled.  The socket server and the HTTP front submit to it; neither is imported here."""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ._lib import DFlashError
from ._handles import Context
from .decoder import Decoder
from .params import GenParams

from .serve_protocol import (THINK_OPEN, BAD_REQUEST, CANCEL_REASONS, CHOICE_FAILED, CLIENT_GONE, INTERNAL, PromptTokenizer, PromptTooLong, RequestError, SHUTDOWN, StopMatcher, TIMEOUT, chat_text, event_error, too_long)

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

    def __init__(self, decoder: Decoder, request_timeout: float = 0.0, log: Callable[[str], None] = lambda m: None,
                 parallel: int = 1):
        if parallel < 1:
            raise DFlashError(f"parallel must be at least 1 (got {parallel})")
        self.decoder = decoder
        self.parallel = parallel
        self.request_timeout = request_timeout
        self.log = log
        self.prompts = PromptTokenizer(decoder.tokenizer)
        self.n_vocab = decoder.info["n_vocab"]
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self.running_jobs: list[Job] = []
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

    @property
    def running(self) -> Job | None:
        """A running job (the first), None when every slot is free."""
        with self._lock:
            return self.running_jobs[0] if self.running_jobs else None

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
        else:
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
            if "messages" in params and self.decoder.prefix_cache is not None:   # where the history ends
                p["history"] = self.decoder.history_len(params["messages"], p["prompt_ids"], params["params"].tools,
                                                        params.get("chat_template_kwargs"))
            if not p["prompt_ids"]:
                raise RequestError("empty prompt: give at least one token")
        self._check_constraint(params["params"], p["prompt_ids"])
        return p

    def _check_constraint(self, gp: GenParams, ids: list[int]) -> None:
        """A schema, grammar or tool set compiled here, before the request queues: a bad one is refused at
        once, and a good one is compiled off the decode thread (the decoder finds it in constraint.py's
        cache), so no running slot waits for it."""
        from .tool_calls import request_grammar
        try:
            request_grammar(gp, self.decoder.opens_thinking(ids))
        except DFlashError as e:
            raise RequestError(str(e)) from None

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
            ahead = len(self._waiting) + max(0, len(self.running_jobs) - self.parallel + 1)
            self._waiting.append(job)
        if job.deadline is not None:  # a waiting job times out at its deadline, not when it reaches the worker
            job.timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), job.cancel, TIMEOUT)
        self._queue.put(job)
        return job, ahead

    def queue_length(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self.running_jobs)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return len(self.running_jobs), len(self._waiting)

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
        with self._lock:
            running = list(self.running_jobs)
        for job in running:
            job.cancel(SHUTDOWN)
        self._queue.put(None)
        self._worker.join(timeout=timeout)

    # -- worker side ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        runs = self._runs = {}   # slot -> the job decoding there
        closing = False
        while True:
            # fill the free slots from the queue (wait for one only when nothing runs)
            while len(runs) < self.parallel and not closing:
                try:
                    job = self._queue.get(block=not runs)
                except queue.Empty:
                    break
                if job is None:   # close(): the running jobs (cancelled) end at their next check
                    closing = True
                    break
                with self._lock:
                    if job.state != WAITING:   # dropped while it waited
                        continue
                    self._waiting.remove(job)
                    job.state = RUNNING
                    self.running_jobs.append(job)
                slot = next(k for k in range(self.parallel) if k not in runs)
                run = _JobRun(self, job, self.decoder._slot(slot))
                # its prompt is prefilled chunk by chunk, the running jobs stepping once after each chunk
                if run.start(between_chunks=self._step if runs else None):
                    runs[slot] = run
                else:
                    self._finish(slot, run)
            if not runs:
                if closing:
                    return
                continue
            self._step()

    def _step(self) -> None:
        """One step of every running job: their verify batches in one forward."""
        runs = self._runs
        decided = time.monotonic()   # before the checks: a cancel after it counts as one the step missed
        for slot in [k for k, r in runs.items() if r.job.stop_requested()]:
            run = runs.pop(slot)
            run.cancelled = True
            self._finish(slot, run)
        if not runs:
            return
        order = sorted(runs)
        try:
            step = Context.generate_next_many([runs[k].view._ctx for k in order])
        except DFlashError as e:   # one slot's error fails the step: end every job it held with it
            for k in order:
                runs[k].fail(e)
                self._finish(k, runs.pop(k))
            return
        for k, toks in zip(order, step):
            if not runs[k].feed(toks, decided):
                self._finish(k, runs.pop(k))

    def _finish(self, slot: int, run: "_JobRun") -> None:
        job = run.job
        try:
            end = run.end()
        except Exception as e:  # noqa: BLE001 - the job ends with an error, the worker keeps serving
            end = self._error_end(job, e)
        with self._lock:  # finished before the client can read its end: health never counts it
            job.state = FINISHED
            if job in self.running_jobs:
                self.running_jobs.remove(job)
            self.served += 1
        job.finished()
        job.emit(end)
        job.emit(None)

    def _error_end(self, job: Job, e: BaseException) -> dict:
        """The terminal event of a job whose decode raised."""
        if isinstance(e, DFlashError):
            if job.cancelled.is_set():  # e.g. "prefill cancelled": say why it was cancelled instead
                return self._early_end(job, None)
            return event_error(str(e), getattr(e, "code", BAD_REQUEST))
        # a bug: the log gets the traceback, the client a plain message; keep serving
        self.log("internal error while decoding:\n" + "".join(traceback.format_exception(e)).rstrip())
        return event_error("internal error while decoding (the daemon's log has the details)", INTERNAL)

    def _unstarted_end(self, job: Job) -> dict:
        if job.reason == TIMEOUT:
            return event_error(f"timed out after {job.timeout:g} s waiting in the queue (timeout)", TIMEOUT)
        if job.reason == SHUTDOWN:
            return event_error("the daemon is shutting down: the request was not started", SHUTDOWN)
        return _cancelled(job)

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
        return _cancelled(job)

    def _count_after_cancel(self, job: Job, decided: float, n_tokens: int) -> None:
        if job.cancel_time is not None and job.cancel_time < decided:
            self.cancel_stats.steps_after += 1
            self.cancel_stats.tokens_after += n_tokens

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


def _cancelled(job: Job) -> dict:
    """The end of a job its client's side cancelled: the client left, or another choice of its request failed."""
    if job.reason == CHOICE_FAILED:
        return event_error("cancelled: another choice of the request failed", CHOICE_FAILED)
    return event_error("cancelled: the client went away", CLIENT_GONE)


class _Stopped(Exception):
    """A job cancelled between the chunks of its prompt's log-probabilities."""


class _JobRun:
    """One running job on a slot: its prompt prefilled by start(), then each batched step's tokens fed in
    (stop strings, streamed events), and its terminal event from end()."""

    def __init__(self, service: DecodeService, job: Job, view: Decoder):
        self.service, self.job, self.view = service, job, view
        p = job.params
        self.stop = StopMatcher(p["stop"])
        self.sd = None
        self.tokens: list[int] = []
        self.stopped = self.cancelled = False
        self.error: dict | None = None
        self.want_lp = p["params"].logprobs is not None
        self.prompt_lps: list[dict] | None = None   # asked with prompt_logprobs: computed before the prefill
        self.steps = None

    def start(self, between_chunks: Callable[[], None] | None = None) -> bool:
        """Prefill and the first token (no forward of its own); False when the job has ended already.
        between_chunks: run after each prefill chunk (the other slots' step), so no running reply waits longer
        than one chunk for a new prompt."""
        job, p = self.job, self.job.params

        def on_prefill(done: int, total: int) -> bool:
            if job.stop_requested():
                return True
            if between_chunks is not None and done < total:
                between_chunks()
            return False
        try:
            job.emit({"event": "start"})
            self.sd = self.view.tokenizer.stream_decoder()
            if job.stop_requested():   # cancelled between the queue and its slot
                self.cancelled = True
                return False
            if p.get("prompt_logprobs") is not None:
                # a forward of its own over the prompt (every row's logits), the others stepping between its
                # chunks as between a prefill's; a cancel ends it at the next chunk
                def between() -> None:
                    if job.stop_requested():
                        raise _Stopped
                    if between_chunks is not None:
                        between_chunks()
                try:   # (kept: the decode below goes on from the prompt's last token, not the whole prompt again)
                    self.prompt_lps = self.view.prompt_logprobs(p["prompt_ids"], p["prompt_logprobs"], between,
                                                                keep=True)
                except _Stopped:
                    self.cancelled = True
                    return False
                if p["stream"]:
                    job.emit({"event": "prompt_logprobs", "logprobs": self.prompt_lps})
            self.steps = self.view.stream_ids(p["prompt_ids"], params=p["params"], cache=p.get("cache_prompt", True),
                                              on_prefill=on_prefill, history=p.get("history"),
                                              held=len(p["prompt_ids"]) - 1 if self.prompt_lps is not None else 0)
            return self._take(time.monotonic())   # (the first token: decided with the prefill)
        except Exception as e:  # noqa: BLE001 - every failure becomes the job's terminal event
            self.fail(e)
            return False

    def feed(self, toks: list[int], decided: float) -> bool:
        """The tokens one batched step (begun at `decided`) gave this job; False when the job has ended."""
        self.view._batched = toks
        try:
            return self._take(decided)
        except Exception as e:  # noqa: BLE001
            self.fail(e)
            return False

    def fail(self, e: BaseException) -> None:
        self.error = self.service._error_end(self.job, e)

    def _take(self, decided: float) -> bool:
        toks = next(self.steps, None)
        if toks is None:
            return False
        self.service._count_after_cancel(self.job, decided, len(toks))
        self.tokens += toks
        piece, self.stopped = self.stop.push("".join(self.sd.push(t) for t in toks))
        if self.job.params["stream"]:
            ev = {"event": "token", "ids": toks, "text": piece}
            if self.want_lp:
                ev["logprobs"] = self.view.last_logprobs(len(self.tokens) - len(toks))
            self.job.emit(ev)
        return not self.stopped

    def end(self) -> dict:
        """The job's terminal event (its stream closed: the prefix cache keeps what it decoded)."""
        job, p, view, svc = self.job, self.job.params, self.view, self.service
        if self.steps is not None:
            try:
                self.steps.close()
            except Exception as e:  # noqa: BLE001
                self.fail(e)
        if self.error is not None:
            return self.error
        if self.steps is None:   # never started
            return svc._early_end(job, None)
        stats = svc._account(view.last_stats().to_dict())
        cancelled = self.cancelled
        if cancelled and job.reason != TIMEOUT:
            return svc._early_end(job, {"tokens": self.tokens})
        stop, stream = self.stop, p["stream"]
        if not self.stopped and self.sd is not None:
            piece, self.stopped = stop.push(self.sd.flush())
            piece += "" if self.stopped else stop.flush()
            if stream and piece:
                job.emit({"event": "token", "ids": [], "text": piece})
        if self.stopped:
            stats["stop_reason"] = "stop"
        done = {"event": "done", "tokens": self.tokens, "text": stop.text, "stats": stats}
        if "think_open" in p:   # a chat request: the reply as an assistant message (reasoning, tool calls)
            done["message"] = view.reply_message(stop.text, p["params"])
        if self.want_lp:
            done["logprobs"] = view.last_logprobs()[:len(self.tokens)]
        if self.prompt_lps is not None:
            done["prompt_logprobs"] = self.prompt_lps
        return svc._early_end(job, done) if cancelled else done
