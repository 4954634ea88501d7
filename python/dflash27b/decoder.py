"""`Decoder`: the Python face of the engine.

Loads a qwen35 GGUF (weights through the C core, tokenizer and chat template
from the same file's metadata), and decodes with the core's generation loop.
Results are frozen dataclasses; the names here (generate/stream/logits/
tokenize/detokenize, stats fields) are the interface scripts rely on.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Sequence

import numpy as np

from . import _handles
from ._lib import TYPE_IDS, DFlashError, load
from .params import INT32_MAX, MODES, GenParams, is_int
from .results import GenerateResult, GenerateStats
from .tokenizer import Tokenizer

# llama.cpp's limit too (GGML_MAX_N_THREADS): a million threads had been started, and the call never returned
MAX_THREADS = 512


def _integer(t) -> bool:
    """A token id's type: a Python or numpy integer, not a bool (a float or a string had gone through int())."""
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
STATE_TYPES = ("f32", "bf16", "f16")
DEVICES = ("auto", "cpu", "cuda")
_MODE_IDS = {"ar": 0, "chain": 1, "ddtree": 2, "auto": 3}


BUNDLED_DIR = Path(__file__).resolve().parent / "models"


LOOKUP = "lookup"    # draft= / -md: prompt lookup instead of a drafter file
LOOKUP_BLOCK = 9     # its draft tokens a step, the root included
MTP = "mtp"          # draft= / -md: the target's own MTP head (an "-MTP" GGUF)
MTP_BLOCK = 4        # its draft tokens a step, the root included (3 drafts, as llama.cpp's default)


# The warm-up's decodes ask for this many tokens beyond their steps, so each step's block is a whole one (a
# block is cut to the tokens still to come); more than any drafter's block (DFlash 16, a draft model's 9).
_WARM_UP_BLOCK_ROOM = 64


def bundled_pair() -> tuple[Path, Path] | None:
    """(target GGUF, drafter dir) of the tiny pair shipped inside the package, if this install has it."""
    # the DFlash2 drafter (tiny-draft2) accepts more than the DFlash one (tiny-draft, kept for v1 users and
    # tests): bench/results/dflash2-cpu.json
    t, d = BUNDLED_DIR / "tiny-target.gguf", BUNDLED_DIR / "tiny-draft2"
    return (t, d) if t.is_file() and (d / "config.json").is_file() else None


def cuda_build() -> str:
    """What the core was built with for CUDA: "not built", "emulator" (tests only) or "sm_86,..."."""
    ffi, lib = load()
    return ffi.string(lib.dfl_build_info()).decode().split("cuda: ", 1)[-1]


def cuda_available() -> bool:
    """True when the core was built with CUDA (devices are checked by the backend itself)."""
    return cuda_build() != "not built"


def cuda_device_count() -> int:
    _, lib = load()
    return int(lib.dfl_cuda_device_count())


def resolve_device(device: str) -> str:
    """"auto" is the GPU when this build has the CUDA backend and a device is present, else the CPU;
    "cuda" never falls back: a user who asks for the GPU must know when they are not on it."""
    if device not in DEVICES:
        raise DFlashError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)}")
    build = cuda_build()
    if device == "cuda":
        if build == "not built":
            raise DFlashError("device 'cuda' requested but this build of dflash27b has no CUDA backend "
                              "(dflash27b --version shows what was built); use the CPU (--device cpu, device='cpu')")
        if cuda_device_count() <= 0:
            raise DFlashError("device 'cuda' requested but no CUDA device is usable (no GPU or no driver); "
                              "use the CPU (--device cpu, device='cpu')")
        return "cuda"
    if device == "auto" and build not in ("not built", "emulator") and cuda_device_count() > 0:
        return "cuda"
    return "cpu"


def _check_same_vocab(target: str, draft: str) -> None:
    """A draft model must speak the target's tokens: the same vocabulary, token for token."""
    a, b = Tokenizer.from_gguf(target).tokens, Tokenizer.from_gguf(draft).tokens
    if a != b:
        where = f"sizes {len(b)} and {len(a)}" if len(a) != len(b) else \
            f"token {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)} differs"
        raise DFlashError(f"draft model {draft} and target {target} have different vocabularies ({where}): a draft "
                          "model must use the target's tokenizer")


def format_memory_plan(plan: dict, device: str) -> str:
    """One line per part, as printed before a CUDA context uploads anything."""
    from .memory_plan import format_plan
    return format_plan(plan, device)


def check_plan_fits(plan: dict) -> None:
    """Refuses (before anything is uploaded) a plan larger than the GPU's free memory, naming the parts
    and what to change."""
    from ._lib import load
    from .memory_plan import PART_NAMES, PARTS
    ffi, lib = load()
    m = ffi.new("dfl_cuda_memory*")
    if lib.dfl_cuda_memory_stats(m, 0) != 0:
        return  # no usable device: the context's own creation says so
    if plan["total"] <= m.device_free:
        return
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    parts = ", ".join(f"{PART_NAMES[k]} {mib(plan[k])}" for k in PARTS if plan.get(k))
    raise DFlashError(f"the model does not fit on the GPU: it needs {mib(plan['total'])} ({parts}) but "
                      f"{mib(m.device_free)} of {mib(m.device_total)} are free; use a smaller context (-c), a "
                      "smaller KV type (--kv-type q4_0), a smaller feature ring or a smaller quant "
                      "(`dflash27b plan --fit` finds options that fit)")


def _draft_sources(draft) -> list[str]:
    """The drafters asked for: None, one source, or several (a list, or sources joined by '+'); each a DFlash
    drafter directory, a draft-model GGUF, a Hugging Face repo id, or "lookup"; resolved, duplicates refused."""
    if draft is None:
        return []
    items = list(draft) if isinstance(draft, (list, tuple)) else [draft]
    parts = [p.strip() for d in items for p in (str(d).split("+") if not Path(str(d)).exists() else [str(d)])]
    if not parts or any(not p for p in parts):
        raise DFlashError(f"draft {draft!r}: an empty drafter name")
    from .model_paths import resolve_draft
    out = [p if p in (LOOKUP, MTP) else str(resolve_draft(p)) for p in parts]
    if len(set(out)) != len(out):
        raise DFlashError(f"draft {draft!r} names a drafter twice")
    return out


class Decoder:
    """A loaded target model with one decoding context.

    >>> with Decoder("model.gguf") as d:
    ...     print(d.generate("def fib(n):", max_new_tokens=32).text)

    draft_type: None keeps the drafter's weights as stored (BF16 for z-lab's); "q8_0" quantises its matrices
    at load (half the memory; the drafter only proposes, so the output is unchanged, acceptance may move).
    warm_up: with a drafter, measure at load what auto mode's probes cost (one short speculative decode and one
    short auto decode), so its first probe is priced like the others.
    cache_mem: bytes for a prefix cache (0 = none): checkpoints of earlier prompts' and replies' states
    (KV rows + delta-net state), so a prompt that starts like an earlier one (a chat's next turn) prefills
    only what is new; the decode equals a cold one token for token (`generate(..., cache=False)` bypasses).
    slots: contexts of `ctx` each made at load (a server's --parallel; generate_many makes more as it needs
    them): each holds its own sequence on the one backend, and the memory plan counts them all.
    state_type: the delta-net recurrent state's storage, "f32" (default), "bf16" or "f16": rounded after every
    token alike in AR steps and tree verifies, so speculation stays exact for each choice; the model itself
    moves slightly from F32 (bench/state_type.py measures how far).
    """

    def __init__(self, target: str | os.PathLike | None = None, draft: str | os.PathLike | None = None, *,
                 device: str = "auto",
                 kv_type: str = "f16", ctx: int = 4096, threads: int | None = None, batch: int = 512,
                 feature_ring: int = 4096, draft_type: str | None = None, state_type: str = "f32",
                 cache_mem: int = 0,
                 on_memory_plan: Callable[[dict], None] | None = None, warm_up: bool = True, slots: int = 1):
        if kv_type not in KV_TYPES:
            raise DFlashError(f"unknown kv_type {kv_type!r}: choose one of {', '.join(KV_TYPES)}")
        # the sizes the core takes as 32-bit ints, checked here (Python's OverflowError / TypeError otherwise)
        for name, v, lo, hi in (("ctx", ctx, 1, INT32_MAX), ("batch", batch, 1, INT32_MAX),
                                ("feature_ring", feature_ring, 1, INT32_MAX), ("slots", slots, 1, 4096),
                                ("threads", 1 if threads is None else threads, 1, MAX_THREADS)):
            if not is_int(v) or not lo <= v <= hi:
                raise DFlashError(f"{name} must be an integer from {lo} to {hi} (got {v!r})")
        if not is_int(cache_mem):
            raise DFlashError(f"cache_mem must be a whole number of bytes (got {cache_mem!r})")
        if state_type not in STATE_TYPES:
            raise DFlashError(f"unknown state_type {state_type!r}: choose one of {', '.join(STATE_TYPES)}")
        self.state_type = state_type
        if cache_mem < 0:
            raise DFlashError(f"cache_mem must be >= 0 bytes (got {cache_mem})")
        from .prefix_cache import PrefixCache
        # earlier prompts' and replies' states, reused by prompts that start the same way (0 = off)
        self.prefix_cache = PrefixCache(cache_mem, every=batch) if cache_mem else None
        self.device = resolve_device(device)
        if target is None:
            pair = bundled_pair()
            if pair is None:
                raise DFlashError("no target model given and this install has no bundled tiny pair "
                                  "(pass target=PATH.gguf)")
            target, draft = pair[0], pair[1] if draft is None else draft
        from .model_paths import resolve_target
        self.target = str(resolve_target(target))
        drafts = _draft_sources(draft)
        # "lookup": prompt lookup drafts (no weights): what followed the same words earlier in the context
        self._lookup = LOOKUP in drafts
        self._mtp = MTP in drafts
        self.kv_type = kv_type
        self.threads = threads if threads else (os.cpu_count() or 1)
        self._model = _handles.Model(self.target)
        self._ctx = None
        self._use = SimpleNamespace(guard=threading.Lock(), owner=None)   # _claim: one user (thread) at a time
        self._draft = None
        self._draft_model = None  # a plain qwen35 GGUF drafting for the target (classic draft-model speculation)
        # several drafters: auto mode picks, each step, the one expected to give the most tokens per second
        self.draft = " + ".join(drafts) if drafts else None
        self.drafts = tuple(drafts)
        try:
            for src in drafts:
                if src in (LOOKUP, MTP):
                    continue
                if Path(src).is_file():
                    if self._draft_model is not None:
                        raise DFlashError(f"two draft models given ({self._draft_model_path} and {src}): one at a time")
                    self._draft_model = _handles.Model(src)
                    self._draft_model_path = src
                    _check_same_vocab(self.target, src)
                else:
                    if self._draft is not None:
                        raise DFlashError(f"two DFlash drafters given ({self._draft_path} and {src}): one at a time")
                    # The pair is validated by the core; a mismatch names the offending field.
                    self._draft = _handles.Draft(src, self._model, draft_type)
                    self._draft_path = src
            dev_id = 1 if self.device == "cuda" else 0
            # What the context will hold on its device (tree state for 32 verify nodes, as the core
            # plans), computed from the mapped files before anything is uploaded (memory_plan.py).
            from .memory_plan import plan_for
            plan = plan_for(self._model, self._draft.info if self._draft is not None else None, ctx=ctx,
                            kv_type=kv_type, nodes=32, feature_ring=feature_ring, batch=batch,
                            device=self.device, state_type=state_type, draft_model=self._draft_model,
                            slots=slots).as_dict()
            self.memory_plan = plan
            if on_memory_plan is not None:
                on_memory_plan(dict(plan))
            if self.device == "cuda":
                check_plan_fits(plan)
            self._ctx = _handles.Context(self._model, ctx, batch, self.threads, TYPE_IDS[kv_type], dev_id,
                                         TYPE_IDS[state_type])
            self._ctx_args = (ctx, batch, self.threads, TYPE_IDS[kv_type], dev_id, TYPE_IDS[state_type])
            self._feature_ring = feature_ring
            self.backend = self._ctx.backend
            if MTP in drafts and not self._model.info.get("n_mtp_layers"):
                raise DFlashError(f"{self.target} has no MTP head (no blk.N.nextn.* tensors): "
                                  "-md mtp needs a GGUF converted with it (llama.cpp's converter without "
                                  "--no-mtp, the \"-MTP\" files)")
            self._attach_drafters(self._ctx)
        except DFlashError:
            self.close()
            raise
        try:
            self.tokenizer = Tokenizer.from_gguf(self.target)   # (TokenizerError names the file and the key)
        except DFlashError:
            self.close()
            raise
        self.n_ctx = ctx
        self._batch = batch
        self._warmed = self._has_drafter() and warm_up
        if self._warmed:
            self._warm_up()
        try:   # the slots last: each is a view of the Decoder as loaded
            for k in range(1, slots):
                self._slot(k)
        except DFlashError:
            self.close()
            raise

    def _attach_drafters(self, ctx) -> None:
        # attached in the order given: the order of preference (chain and DDTree modes draft with the first)
        for src in self.drafts:
            if src == MTP:
                ctx.attach_mtp(MTP_BLOCK)
            elif src == LOOKUP:
                ctx.attach_lookup(block=LOOKUP_BLOCK)
            elif self._draft_model is not None and src == self._draft_model_path:
                ctx.attach_draft_model(self._draft_model)
            else:
                ctx.attach_draft(self._draft, self._feature_ring)

    def _slot(self, k: int) -> "Decoder":
        """Slot k for generate_many: a view of this Decoder (model, tokenizer, drafters' weights, prefix cache
        shared) with a context of its own on the same backend; slot 0 is this Decoder's own context."""
        if k == 0:
            return self
        slots = self.__dict__.setdefault("_slots", {})
        if k not in slots:
            import copy
            view = copy.copy(self)
            view._slot_of = self
            view.__dict__.pop("_slots", None)
            view._ctx = _handles.Context(self._model, *self._ctx_args, share=self._ctx)
            view._attach_drafters(view._ctx)
            view._batched = None
            if getattr(self, "_warmed", False):
                view._warm_up()   # its drafters' buffers, and auto's prices for this slot's first probe
            slots[k] = view
        return slots[k]

    def _next_tokens(self) -> list[int]:
        # generate_many steps every slot in one batched forward and hands each its tokens here
        batched = getattr(self, "_batched", None)
        if batched is not None:
            self._batched = None
            return batched
        return self._ctx.generate_next()

    def generate_many(self, prompts: Sequence, max_new_tokens: int | None = None, *, parallel: int | None = None,
                      chat: bool = False, cache: bool = True, params: GenParams | None = None,
                      chat_template_kwargs: dict | None = None, **settings) -> list[GenerateResult]:
        """Decodes several prompts at once (offline batching): up to `parallel` (default: all) run in slots,
        each its own context on this Decoder's backend, and every step of the running ones is one batched
        target forward (the weights read once for all of them); a finished slot takes the next prompt.  Each
        result is exactly what generate() gives for that prompt alone (greedy and seeded), stats included.
        Settings as generate(); `params` may be one GenParams for all or a list, one per prompt."""
        prompts = list(prompts)
        if not prompts:
            return []
        if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
            raise DFlashError(f"parallel must be an integer of at least 1 (got {parallel!r})")
        n_slots = min(len(prompts), parallel or len(prompts))
        per = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise DFlashError(f"{len(per)} params for {len(prompts)} prompts")
        results: list[GenerateResult | None] = [None] * len(prompts)
        queue = list(range(len(prompts)))
        running: dict[int, tuple] = {}   # slot -> (prompt index, its stream, its tokens, its params)

        def start(slot: int) -> None:
            while queue:
                i = queue.pop(0)
                view = self._slot(slot)
                p = view._settings(per[i], max_new_tokens, settings)
                stream = view.stream_ids(prompts[i], chat=chat, cache=cache, params=p,
                                         chat_template_kwargs=chat_template_kwargs)
                toks = next(stream, None)   # the prefill, and the first token (no forward of its own)
                if toks is None:
                    finish(view, i, [], p)
                    continue
                running[slot] = (i, stream, list(toks), p)
                return

        def finish(view, i, tokens, p) -> None:
            results[i] = view._result(tokens, p, chat)

        with self._exclusive():   # (every slot shares the backend)
            for slot in range(n_slots):
                start(slot)
            while running:
                slots = sorted(running)
                views = [self._slot(k) for k in slots]
                step = _handles.Context.generate_next_many([v._ctx for v in views])
                for slot, view, toks in zip(slots, views, step):
                    i, stream, tokens, p = running[slot]
                    view._batched = toks
                    got = next(stream, None)   # the stream yields them, or ends on an empty step
                    if got is not None:
                        tokens.extend(got)
                        continue
                    finish(view, i, tokens, p)
                    del running[slot]
                    start(slot)
        return results  # type: ignore[return-value]

    def _warm_up(self) -> None:
        """Measures, at load, what auto mode's first probe would cost: a speculative decode first (buffers,
        graphs and caches warm, nothing recorded), then a few auto steps (one AR step, one probe per drafter)
        that the controllers price their later probes by, then the verify forward of each tree size auto may
        choose.  A drafter that costs many AR steps is then probed only as often as its measured loss allows,
        so a short request stays at AR's speed; a cheap one is probed at once; and a first tree of a size is
        priced by what that size costs here (on a CPU an 8-node verify costs three AR steps).  The steps draft
        whole blocks, as a request's do: a block drafter's forward grows with its rows (a 16-row DFlash block
        costs ~4x a 4-row one on a CPU), and a probe priced at the short block of a request's last tokens bet
        four times what the allowance meant to."""
        prompt = [int(t) for t in self.tokenize("def f(x):\n")] or [0]
        budget = min(4, self._batch - 1)   # small trees: a draft's cost hardly depends on the budget, its rows do
        n_steps = 2 + 2 * max(1, len(self.drafts))
        # room for more than any drafter's block after the steps (a block is cut to the tokens still to come)
        max_new = min(n_steps + _WARM_UP_BLOCK_ROOM, self.n_ctx - len(prompt) - 1)
        if budget < 1 or max_new < n_steps + 2:
            return  # too small a context to measure in
        for mode, steps in (("ddtree", 2), ("auto", n_steps)):
            run = self.stream_ids(prompt, max_new, mode=mode, ignore_eos=True, cache=False, budget=budget)
            for k, _ in enumerate(run, 1):
                if k >= steps:
                    break
            run.close()   # (a decode left mid-way: the next begin starts afresh)
        # and the verify of every tree size auto mode may choose (default budget + the root), timed, not guessed
        self._ctx.measure_verify(min(self._batch, GenParams().budget + 1))

    @staticmethod
    def connect(socket_path: str | os.PathLike, timeout: float | None = None):
        """A client of a running daemon (`dflash27b serve --socket PATH`) with the same generate/stream
        interface; the models stay loaded in the daemon between calls."""
        from .client import RemoteDecoder
        return RemoteDecoder(os.fspath(socket_path), timeout=timeout)

    # -- model facts -----------------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        return dict(self._model.info)

    @property
    def draft_info(self) -> dict | None:
        return dict(self._draft.info) if self._draft is not None else None

    @property
    def default_mode(self) -> str:
        """auto with a drafter (each step AR or the DDTree budget that pays most), else ar."""
        return "auto" if self._has_drafter() else "ar"

    def _has_drafter(self) -> bool:
        return (self._draft is not None or self._draft_model is not None or getattr(self, "_lookup", False)
                or getattr(self, "_mtp", False))

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids

    # -- text <-> ids -----------------------------------------------------------------------------------
    def tokenize(self, text: str, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise DFlashError(f"tokenize() takes text (got {type(text).__name__})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:   # a lone surrogate: bytes that were not UTF-8 (argv, a file read as such)
            raise DFlashError(f"the text is not valid UTF-8 (position {e.start}: "
                              f"{text[e.start:e.end].encode('utf-8', 'surrogateescape')!r})") from None
        return self.tokenizer.encode(text, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        n = self.tokenizer.vocab_size
        bad = next((t for t in ids if not _integer(t) or not 0 <= t < n), None)
        if bad is not None:   # (a negative id had wrapped around to the vocabulary's end)
            raise DFlashError(f"token id {bad!r} is not in the vocabulary (0..{n - 1})")
        return self.tokenizer.decode(ids)

    def chat_prompt(self, messages: list[dict] | str, tools: list | None = None, **kwargs) -> str:
        """The generation prompt of `messages` (a string: one user message) by the GGUF's chat template;
        tools: OpenAI's tools list, which the template lists for the model; keywords: template variables."""
        from .tool_calls import template_messages
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if tools is not None:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True, **kwargs)

    def opens_thinking(self, ids: Sequence[int]) -> bool:
        """The prompt ends inside a thinking block it opened (Qwen3.5's generation prompt ends with <think>):
        the reply's first part is thinking, and a constraint shapes what follows it."""
        return self.detokenize(list(ids[-16:])).rstrip().endswith("<think>")

    def _prompt_ids(self, prompt: str | Sequence[int] | Sequence[dict], chat: bool, tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        if chat and not isinstance(prompt, str) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.tokenize(self.chat_prompt(list(prompt), tools=tools, **(template_kwargs or {})))
        if isinstance(prompt, str):
            return self.tokenize(self.chat_prompt(prompt, tools=tools, **(template_kwargs or {})) if chat else prompt)
        return self._token_ids(prompt, chat)

    def _token_ids(self, prompt, chat: bool = False) -> list[int]:
        """A prompt given as token ids: integers only (a float, a bool, a string or bytes had been converted
        with int(), silently), each in the vocabulary."""
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence) and not isinstance(
                prompt, np.ndarray):
            raise DFlashError(f"a prompt is text, a list of token ids or (chat) a list of messages, not "
                              f"{type(prompt).__name__}")
        if any(isinstance(t, dict) for t in prompt):
            raise DFlashError("a list of messages is a chat prompt: pass chat=True (and only messages)")
        ids = []
        for t in prompt:
            if not _integer(t):
                raise DFlashError(f"prompt token ids must be integers (got {t!r})")
            ids.append(int(t))
        if chat:
            raise DFlashError("chat takes text or a list of messages, not token ids (they are the prompt as given)")
        if getattr(self, "_ctx", None) is None:
            raise DFlashError("this Decoder is closed")
        bad = [t for t in ids if not 0 <= t < self._ctx.n_vocab]
        if bad:
            raise DFlashError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self._ctx.n_vocab - 1})")
        return ids

    # -- decoding ---------------------------------------------------------------------------------------
    def _resolve_mode(self, mode: str | None, block_size: int | None) -> tuple[str, int]:
        """(mode, block size); the default mode is auto with a drafter, else ar."""
        mode = self.default_mode if mode is None else mode
        if mode not in MODES:
            raise DFlashError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
        if mode == "ar":
            return mode, 1
        oracle = self._ctx.has_topk_hook and mode in ("ddtree", "auto")  # tests: a hook drafts instead
        if not self._has_drafter() and not oracle:
            raise DFlashError(f"mode {mode!r} needs a drafter: pass draft=PATH (CLI: -md/--draft)")
        if block_size is not None:
            bs = int(block_size)
        elif len(self.drafts) > 1:
            return mode, 0   # several drafters: each drafts its own block (the core takes each one's default)
        elif self._draft is not None:
            bs = self._draft.info["block_size"]
        elif self._mtp:
            bs = MTP_BLOCK
        elif self._lookup:
            bs = LOOKUP_BLOCK
        else:
            bs = 9 if self._draft_model is not None else 16  # a draft model: 8 draft tokens a step
        if bs < 1:
            raise DFlashError(f"block_size must be >= 1 (got {bs})")
        return mode, bs

    def _settings(self, params: GenParams | None, max_new_tokens: int | None, settings: dict) -> GenParams:
        """The request's GenParams: params (else the defaults) with max_new_tokens and keyword settings over it;
        a keyword that is not a setting is refused by name."""
        if max_new_tokens is not None:
            settings = {"max_new_tokens": max_new_tokens, **settings}
        return GenParams.from_mapping(settings, strict=True, base=params or GenParams())

    # -- one user at a time ------------------------------------------------------------------------------
    # A Decoder (with its slots: one backend) is used by one thread at a time: from a decode's first step to its
    # end, or for the whole of a logits() call.  Another thread arriving meanwhile is refused (two threads on one
    # context had returned wrong tokens as if they had succeeded, then crashed); a thread that died holding it
    # gives it up.  The same thread may start another decode while a stream is open: the stream then ends with
    # an error at its next step instead of yielding nothing, and leaves the context to the new decode.

    def _claim(self):
        """Take the Decoder for this thread; None when this thread holds it already (a nested call)."""
        if getattr(self, "_ctx", None) is None:
            raise DFlashError("this Decoder is closed")
        me, use = threading.current_thread(), self._use
        with use.guard:
            if use.owner is not None and use.owner[0] is me:
                return None
            if use.owner is not None and use.owner[0].is_alive():
                raise DFlashError("this Decoder is decoding in another thread: give each thread its own Decoder, "
                                  "or decode several requests with generate_many() or the daemon (serve --parallel)")
            use.owner = (me, object())
            return use.owner

    def _release(self, claim) -> None:
        if claim is not None:
            with self._use.guard:   # (from any thread: a stream may be finalized by another)
                if self._use.owner is claim:
                    self._use.owner = None

    @contextlib.contextmanager
    def _exclusive(self):
        claim = self._claim()
        try:
            yield
        finally:
            self._release(claim)

    def stream_ids(self, *args, **kwargs) -> Iterator[list[int]]:
        """Yields the tokens committed by each decode step (arguments: _stream_ids'), holding the Decoder for
        this thread from the first step to the end."""
        claim = self._claim()
        self._stream_serial = serial = getattr(self, "_stream_serial", 0) + 1
        steps = self._stream_ids(*args, stream_serial=serial, **kwargs)
        try:
            while True:
                if self._stream_serial != serial:
                    raise DFlashError("a later decode on this Decoder took its context: this stream has ended "
                                      "(finish or close a stream before starting another)")
                toks = next(steps, None)
                if toks is None:
                    return
                yield toks
        finally:
            try:
                steps.close()
            finally:
                self._release(claim)

    def _stream_ids(self, prompt: str | Sequence[int] | Sequence[dict], max_new_tokens: int | None = None, *,
                    chat: bool = False, on_prefill=None, cache: bool = True, params: GenParams | None = None,
                    chat_template_kwargs: dict | None = None, history: int | None = None, held: int = 0,
                    stream_serial: int | None = None, **settings) -> Iterator[list[int]]:
        """Yields the tokens committed by each decode step; `last_stats` holds the stats afterwards.
        chat: the prompt is a user message or a list of OpenAI messages, rendered by the GGUF's chat template
        (with chat_template_kwargs as its variables, e.g. {"enable_thinking": False}, and the tools setting).
        Settings (GenParams fields, see generate()) come as `params` and/or keywords over it.
        `on_prefill(done, total)` is called after each prefill chunk; a truthy return cancels.
        cache: use (and feed) the prefix cache when the Decoder has one.  history: prompt tokens that end the
        conversation's history, before the chat template's generation prompt (found here for chat messages):
        the prefix cache checkpoints there too.  held: the prompt's first tokens the context already holds
        (prompt_logprobs(keep=True) just ran over them), decoded on from there as after a prefix-cache hit."""
        p = self._settings(params, max_new_tokens, settings)
        mode, bs = self._resolve_mode(p.mode, p.block_size)
        if p.seed is None:  # like llama.cpp's default: a fresh seed, reported in the stats
            p = p.with_(seed=int.from_bytes(os.urandom(4), "little"))
        ids = self._prompt_ids(prompt, chat, p.tools, chat_template_kwargs)
        self._last_prompt = ids
        self._last_params, self._last_chat = p, chat
        self._last_mode = (mode, bs, p.budget if mode in ("ddtree", "auto") else 0, p.temperature, p.seed)
        pc = self.prefix_cache if cache else None
        n_keep = 0
        if held:   # the context holds the prompt's first `held` tokens (prompt_logprobs(keep=True) ran over them)
            if not 0 < held < len(ids) or self._ctx.n_past != held:
                raise DFlashError(f"the context holds {self._ctx.n_past} tokens, not the prompt's first {held}")
            n_keep = held
        elif pc is not None:
            ck = pc.lookup(ids)
            if ck is not None:
                n_keep = pc.restore(self._ctx, ck)
        self._last_cached = 0 if held else n_keep
        self._pre_prefill_s = 0.0
        if history is None and pc is not None and chat and not isinstance(prompt, str) and prompt:
            history = self.history_len(list(prompt), ids, p.tools, chat_template_kwargs)
        progress = on_prefill
        if pc is not None:
            saved = [n_keep]

            def progress(done, total):  # checkpoints along a long prompt and at its end
                if done - saved[0] >= pc.every or done == total:
                    pc.save(self._ctx, ids[:done])
                    saved[0] = done
                return on_prefill(done, total) if on_prefill is not None else False
        constraint = None
        self._think_open = self.opens_thinking(ids)
        from .tool_calls import request_grammar
        grammar = request_grammar(p, self._think_open)   # structured output (constraint.py), or None
        if grammar is not None:
            from .constraint import TokenConstraint
            constraint = TokenConstraint(self.tokenizer, self.eos_ids, grammar, self.info["n_vocab"])
        self.last_constraint = constraint
        if progress is not None:
            self._ctx.set_prefill_progress(progress)
        self._ctx.set_constraint(None)   # (the history's prefill below decides no token)
        self._last_tokens: list[int] = []
        try:
            try:
                if pc is not None and history and n_keep < history < len(ids):
                    # the conversation's history first, checkpointed where it ends: the next turn's prompt
                    # starts with it, while the generation prompt and this reply (whose thinking Qwen3.5's
                    # template drops from later turns) would not match it
                    t0 = time.perf_counter()
                    self._ctx.begin(ids[:history], p.with_(max_new_tokens=0), self.eos_ids, 0, 0, n_keep=n_keep)
                    pc.save(self._ctx, ids[:history])
                    n_keep = history
                    self._pre_prefill_s = time.perf_counter() - t0
                self._ctx.set_constraint(constraint, prune=p.grammar_prune)
                self._ctx.begin(ids, p, self.eos_ids, _MODE_IDS[mode], bs if mode != "ar" else 0, n_keep=n_keep)
                self._want_logprobs = p.logprobs is not None
            finally:
                if progress is not None:
                    self._ctx.set_prefill_progress(None)
            while True:
                toks = self._next_tokens()
                if not toks:
                    break
                self._last_tokens += toks
                yield toks
        except DFlashError:
            if constraint is not None and constraint.error is not None:
                raise constraint.error from None
            raise
        finally:
            # a later decode (or close) may have taken the context: then what it holds is not this reply's
            mine = getattr(self, "_ctx", None) is not None and (
                stream_serial is None or getattr(self, "_stream_serial", None) == stream_serial)
            if mine and constraint is not None:
                self._ctx.set_constraint(None)
            if mine and pc is not None:  # the reply's end: the next turn starts with prompt + reply
                held = ids + self._last_tokens
                n = self._ctx.n_past
                if 0 < n <= len(held):
                    pc.save(self._ctx, held[:n])

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int | None = None, *, chat: bool = False,
               **kw) -> Iterator[str]:
        """Yields text pieces as they are decoded (incomplete UTF-8 is held back); keywords as generate()."""
        sd = self.tokenizer.stream_decoder()
        for toks in self.stream_ids(prompt, max_new_tokens, chat=chat, **kw):
            piece = "".join(sd.push(t) for t in toks)
            if piece:
                yield piece
        tail = sd.flush()
        if tail:
            yield tail

    def generate(self, prompt: str | Sequence[int] | Sequence[dict], max_new_tokens: int | None = None, *,
                 chat: bool = False, on_prefill=None, cache: bool = True, params: GenParams | None = None,
                 chat_template_kwargs: dict | None = None, **settings) -> GenerateResult:
        """Decode.  Settings are GenParams fields (python/dflash27b/params.py), as `params` and/or keywords:
        mode "ar" (target only), "chain" (one DFlash block verified per step), "ddtree" (a tree of up to
        `budget` draft nodes, `tree_topk` candidates per depth, optionally seeded with the greedy chain,
        verified in one target forward) or "auto" (each step AR or the DDTree budget up to `budget` that
        maximises expected tokens per second, from costs and acceptance measured while decoding); default
        "auto" when a drafter is loaded.  Every mode gives AR's tokens.

        Sampling follows llama.cpp's order: top_k (0 = off), top_p (1 = off), min_p (0 = off), each on
        the softmax at temperature 1, then temperature (0 = greedy).  The token at position p is drawn
        with a number that depends only on (seed, p), so for a given seed the output is the same token
        for token in every mode (seed None: a fresh one, reported in stats.seed).

        Penalties come first, as llama.cpp's: each token seen c times in the last repeat_last_n tokens (prompt
        included; -1 = all) has its logit divided by repeat_penalty (multiplied when negative), then lowered by
        c * frequency_penalty + presence_penalty.  A verified tree node counts its own ancestors, so
        speculative output still equals AR's.  logprobs=k: each token's log-probability (of the raw logits)
        and its k most likely alternatives, in result.logprobs."""
        p = self._settings(params, max_new_tokens, settings)
        tokens: list[int] = []
        for toks in self.stream_ids(prompt, chat=chat, on_prefill=on_prefill, cache=cache, params=p,
                                    chat_template_kwargs=chat_template_kwargs):
            tokens.extend(toks)
        return self._result(tokens, p, chat)

    def _result(self, tokens: list[int], p: GenParams, chat: bool) -> GenerateResult:
        """The last decode as a result: its tokens and text, stats, log-probs and (chat) the reply message."""
        text = self.detokenize(tokens)
        return GenerateResult(tokens=tokens, text=text, stats=self.last_stats(),
                              prompt_tokens=list(self._last_prompt),
                              logprobs=self.last_logprobs() if p.logprobs is not None else None,
                              message=self.reply_message(text, p) if chat else None)

    def history_len(self, messages: list[dict], ids: Sequence[int], tools: list | None = None,
                    template_kwargs: dict | None = None) -> int:
        """How many of a chat prompt's tokens (`ids`) are the conversation's history: the messages rendered
        without the generation prompt, when their tokens begin `ids` (0 otherwise)."""
        from .tool_calls import template_messages
        kw = dict(template_kwargs or {})
        if tools is not None:
            kw["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=False, **kw)
        except Exception:  # noqa: BLE001 - a template that cannot render the bare history: no boundary
            return 0
        head = self.tokenize(text)
        return len(head) if 0 < len(head) < len(ids) and list(ids[:len(head)]) == head else 0

    def last_message(self) -> dict | None:
        """The last chat decode's reply as an OpenAI assistant message (None after a raw completion)."""
        if not getattr(self, "_last_chat", False):
            return None
        return self.reply_message(self.detokenize(self._last_tokens), self._last_params)

    def reply_message(self, text: str, params: GenParams | None = None) -> dict:
        """A chat reply as an OpenAI assistant message: reasoning_content split out (the template's thinking
        block), tool_calls parsed when the request gave tools (tool_choice not "none")."""
        from .chat_reply import ReplySplit, template_thinks
        from .tool_calls import parse_tools
        tools = parse_tools(params.tools) if params is not None and params.calls_tools else None
        return ReplySplit(template_thinks(self.tokenizer.chat_template), getattr(self, "_think_open", False),
                          tools).message(text)

    def last_logprobs(self, start: int = 0) -> list[dict]:
        """The last decode's per-token log-probabilities (from token index start), when it asked for them."""
        return self._ctx.logprobs(start) if getattr(self, "_want_logprobs", False) else []

    def last_stats(self) -> GenerateStats:
        s = self._ctx.generate_stats()
        steps = self._ctx.step_stats()
        mode, bs, budget, temperature, seed = getattr(self, "_last_mode", ("ar", 1, 0, 0.0, 0))
        after_first = max(s["generated_tokens"] - 1, 0)  # the first new token comes from the prefill
        prefill_s = s["prefill_s"] + getattr(self, "_pre_prefill_s", 0.0)   # the history's part too
        acc = [st["committed"] for st in steps]
        return GenerateStats(
            prompt_tokens=s["prompt_tokens"], generated_tokens=s["generated_tokens"], prefill_s=prefill_s,
            decode_s=s["decode_s"], decode_tok_s=after_first / s["decode_s"] if s["decode_s"] > 0 else 0.0,
            prefill_tok_s=(s["prompt_tokens"] - getattr(self, "_last_cached", 0)) / prefill_s if prefill_s > 0 else 0.0,
            steps=s["steps"], stop_reason=s["stop_reason"], mode=mode, device=self.device,
            cached_tokens=getattr(self, "_last_cached", 0),
            mean_accept=sum(acc) / len(acc) if acc else 0.0, block_size=bs, budget=budget,
            temperature=temperature, seed=seed, accept_lengths=acc,
            draft_ms=[st["draft_s"] * 1e3 for st in steps], tree_ms=[st["tree_s"] * 1e3 for st in steps],
            verify_ms=[st["verify_s"] * 1e3 for st in steps], commit_ms=[st["commit_s"] * 1e3 for st in steps],
            target_forwards=[st["target_forwards"] for st in steps], tree_size=[st["drafted"] for st in steps],
            tree_depth=[st["tree_depth"] for st in steps], draft_depth=[st["draft_depth"] for st in steps],
            merged=[st["merged"] for st in steps],
            auto_budget=[st["auto_budget"] for st in steps],
            probe=[bool(st["probe"]) for st in steps], expected_tokens=[st["expected_tokens"] for st in steps],
            pruned=[st["pruned"] for st in steps], mask_ms=[st["mask_s"] * 1e3 for st in steps],
            est_tok_s=[st["est_tok_s"] for st in steps], est_ar_tok_s=[st["est_ar_tok_s"] for st in steps],
            drafter=self._drafter_names(steps) if mode == "auto" and len(self.drafts) > 1 else [])

    def _drafter_names(self, steps: list[dict]) -> list[str]:
        names = self._ctx.drafter_names()
        return [names[st["drafter"]] if 0 <= st["drafter"] < len(names) and st["auto_budget"] > 0 else ""
                for st in steps]   # (a drafter whose tree lost to AR after drafting verified nothing)

    # -- tools -------------------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [n, vocab]: the logits at every position of `token_ids`, from a fresh state."""
        ids = self._prompt_ids(list(token_ids), chat=False)
        if not ids:
            raise DFlashError("logits() needs at least one token")
        if len(ids) > self.n_ctx:
            raise DFlashError(f"{len(ids)} tokens do not fit the context length {self.n_ctx}")
        with self._exclusive():
            self._ctx.reset()
            lg, _ = self._ctx.forward(ids)
            self._ctx.reset()
        return lg

    def prompt_logprobs(self, token_ids: Sequence[int], k: int = 0, between_chunks=None, keep: bool = False) -> list[dict]:
        """Each token's log-probability given the tokens before it (the first token has none: logprob and top
        None), with its k most likely alternatives (descending, lower id first on ties): the log-softmax of the
        target's raw logits, from a fresh state, 64 positions' rows at a time (between_chunks() after each).
        What OpenAI's echo with logprobs and vLLM's prompt_logprobs return.  It leaves the context reset, or
        with keep, holding every token but the last: a decode of the same prompt then starts from there
        (stream_ids(held=len - 1)) instead of running the prompt again."""
        with self._exclusive():
            return self._prompt_logprobs(token_ids, k, between_chunks, keep)

    def _prompt_logprobs(self, token_ids, k, between_chunks, keep) -> list[dict]:
        ids = self._prompt_ids(list(token_ids), chat=False)
        if not ids:
            raise DFlashError("prompt_logprobs() needs at least one token")
        if len(ids) > self.n_ctx:
            raise DFlashError(f"{len(ids)} tokens do not fit the context length {self.n_ctx}")
        out = [{"token": ids[0], "logprob": None, "top": None}]
        step = max(1, min(64, self._batch))
        self._ctx.reset()
        try:
            for s in range(0, len(ids) - 1, step):   # rows s.. predict tokens s + 1..
                chunk = ids[s:min(s + step, len(ids) - 1)]
                lg, _ = self._ctx.forward(chunk)
                x = lg.astype(np.float64)
                mx = x.max(axis=1)
                lse = mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))
                for r, t in enumerate(ids[s + 1:s + 1 + len(chunk)]):
                    e = {"token": t, "logprob": float(x[r, t] - lse[r]), "top": []}
                    if k > 0:
                        kth = np.partition(lg[r], lg.shape[1] - k)[lg.shape[1] - k] if k < lg.shape[1] else -np.inf
                        cand = sorted(np.flatnonzero(lg[r] >= kth).tolist(), key=lambda i: (-lg[r, i], i))[:k]
                        e["top"] = [(int(i), float(x[r, i] - lse[r])) for i in cand]
                    out.append(e)
                if between_chunks is not None:
                    between_chunks()
        except BaseException:
            self._ctx.reset()
            raise
        if not keep:
            self._ctx.reset()
        return out

    def hidden_states(self, token_ids: Sequence[int], layers: Sequence[int]) -> np.ndarray:
        """float32 [n, len(layers), n_embd]: residual stream after each layer, from a fresh state."""
        ids = self._prompt_ids(list(token_ids), chat=False)
        with self._exclusive():
            self._ctx.reset()
            _, hid = self._ctx.forward(ids, logit_rows=[], capture_layers=list(layers))
            self._ctx.reset()
        return hid

    @property
    def context(self) -> _handles.Context:
        """The raw context (forward with parents, commit_path) for tools and tests."""
        return self._ctx

    def close(self) -> None:
        if getattr(self, "_slot_of", None) is not None:   # a slot view owns its context only
            if getattr(self, "_ctx", None) is not None:
                self._ctx.close()
                self._ctx = None
            return
        for view in self.__dict__.pop("_slots", {}).values():
            view.close()
        if getattr(self, "_ctx", None) is not None:
            self._ctx.close()
            self._ctx = None
        if getattr(self, "_draft", None) is not None:
            self._draft.close()
            self._draft = None
        if getattr(self, "_draft_model", None) is not None:
            self._draft_model.close()
            self._draft_model = None
        if getattr(self, "_model", None) is not None:
            self._model.close()
            self._model = None

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()
