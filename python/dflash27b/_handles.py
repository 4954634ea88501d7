"""Owning wrappers for the core's handles: one class per C handle.

Each frees its handle exactly once (close() or garbage collection) and keeps
the objects it depends on alive (a Context holds its Model).  Arrays cross the
ABI as numpy buffers; nothing is parsed from text.
"""
from __future__ import annotations

import numpy as np

from ._lib import TYPE_IDS, DFlashError, check, load

_STOP_REASONS = {0: "running", 1: "length", 2: "eos", 3: "context_full"}


def _i32(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.int32))


class Model:
    def __init__(self, path: str):
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        h = lib.dfl_model_load(str(path).encode())
        if h == ffi.NULL:
            raise DFlashError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
        self._h = h
        info = ffi.new("dfl_model_info*")
        check(lib.dfl_model_get_info(h, info))
        self.info = {k: getattr(info, k) for k in dir(info)}
        self.path = str(path)

    @property
    def handle(self):
        if self._h is None:
            raise DFlashError("model is closed")
        return self._h

    def layer_is_recurrent(self, layer: int) -> bool:
        return self._lib.dfl_model_layer_is_recurrent(self.handle, layer) == 1

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        ffi, lib = self._ffi, self._lib
        out = []
        name, typ, ne = ffi.new("char**"), ffi.new("uint32_t*"), ffi.new("int64_t[4]")
        for i in range(lib.dfl_model_tensor_count(self.handle)):
            check(lib.dfl_model_tensor_info(self.handle, i, ffi.cast("const char**", name), typ, ne))
            tname = lib.dfl_type_name(typ[0])
            out.append((ffi.string(name[0]).decode(), ffi.string(tname).decode() if tname != ffi.NULL else "?",
                        tuple(int(ne[d]) for d in range(4))))
        return out

    def close(self) -> None:
        if getattr(self, "_h", None) is not None:
            self._lib.dfl_model_free(self._h)
            self._h = None

    def __del__(self):
        self.close()


def context_params(lib, ffi, n_ctx: int, n_batch: int, n_threads: int, kv_type: int, device: int,
                   state_type: int = 0):
    p = lib.dfl_context_default_params()
    p.n_ctx, p.n_batch, p.n_threads, p.kv_type, p.device = n_ctx, n_batch, n_threads, kv_type, device
    p.state_type = state_type
    return ffi.new("dfl_context_params*", p)


def memory_plan(model: Model, n_ctx: int, n_batch: int, kv_type: int, device: int, max_nodes: int,
                state_type: int = 0) -> dict:
    """Bytes the context will need on its device, by part (see dfl_context_memory_plan)."""
    ffi, lib = model._ffi, model._lib
    out = ffi.new("dfl_memory_plan*")
    check(lib.dfl_context_memory_plan(model.handle, context_params(lib, ffi, n_ctx, n_batch, 1, kv_type, device,
                                                                   state_type),
                                      max_nodes, out))
    return {k: int(getattr(out, k)) for k in ("weights", "kv", "recurrent", "tree_state", "workspace", "total")}


class Context:
    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_threads: int, kv_type: int, device: int = 0,
                 state_type: int = 0, share: "Context | None" = None):
        """share: a context of the same model whose backend this one uses too (a slot: dfl_context_new_slot)."""
        ffi, lib = model._ffi, model._lib
        self._ffi, self._lib, self.model = ffi, lib, model
        params = context_params(lib, ffi, n_ctx, n_batch, n_threads, kv_type, device, state_type)
        h = lib.dfl_context_new(model.handle, params) if share is None else \
            lib.dfl_context_new_slot(share.handle, params)
        if h == ffi.NULL:
            raise DFlashError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
        self._h = h
        self.n_vocab = model.info["n_vocab"]
        self.n_embd = model.info["n_embd"]
        self.backend = ffi.string(lib.dfl_context_backend(h)).decode()

    @property
    def handle(self):
        if self._h is None:
            raise DFlashError("context is closed")
        return self._h

    def _p(self, a: np.ndarray, ctype: str = "int32_t*"):
        return self._ffi.cast(ctype, a.ctypes.data) if a is not None and a.size else self._ffi.NULL

    def reset(self) -> None:
        check(self._lib.dfl_context_reset(self.handle))

    @property
    def n_past(self) -> int:
        return self._lib.dfl_context_n_past(self.handle)

    def forward(self, tokens, pos=None, parent=None, logit_rows=None, capture_layers=None, commit=True):
        """Runs the one forward; returns (logits [len(logit_rows), vocab], hidden [n, n_cap, n_embd] or None)."""
        tokens = _i32(tokens)
        n = len(tokens)
        pos = _i32(np.arange(self.n_past, self.n_past + n) if pos is None else pos)
        par = None if parent is None else _i32(parent)
        rows = _i32(np.arange(n) if logit_rows is None else logit_rows)
        caps = _i32([] if capture_layers is None else capture_layers)
        if len(pos) != n or (par is not None and len(par) != n):
            raise DFlashError("tokens, pos and parent must have the same length")
        logits = np.empty((len(rows), self.n_vocab), np.float32)
        hidden = np.empty((n, len(caps), self.n_embd), np.float32) if len(caps) else None
        check(self._lib.dfl_forward(self.handle, n, self._p(tokens), self._p(pos), self._p(par), len(rows),
                                    self._p(rows), self._p(logits, "float*"), len(caps), self._p(caps),
                                    self._p(hidden, "float*") if hidden is not None else self._ffi.NULL,
                                    1 if commit else 0))
        return logits, hidden

    def commit_path(self, nodes) -> None:
        nodes = _i32(nodes)
        check(self._lib.dfl_commit_path(self.handle, self._p(nodes), len(nodes)))

    # -- prefix reuse: KV rows by position range, the delta-net state, the committed length --------------
    @property
    def kv_bytes_per_position(self) -> int:
        return int(self._lib.dfl_context_kv_bytes_per_position(self.handle))

    @property
    def recurrent_bytes(self) -> int:
        return int(self._lib.dfl_context_recurrent_bytes(self.handle))

    def get_kv(self, p0: int, p1: int) -> bytes:
        n = max(0, p1 - p0) * self.kv_bytes_per_position
        buf = self._ffi.new("uint8_t[]", max(n, 1))
        check(self._lib.dfl_context_get_kv(self.handle, p0, p1, buf, n))
        return bytes(self._ffi.buffer(buf, n))

    def set_kv(self, p0: int, p1: int, data: bytes) -> None:
        check(self._lib.dfl_context_set_kv(self.handle, p0, p1, self._ffi.from_buffer(data), len(data)))

    def get_recurrent(self) -> bytes:
        n = self.recurrent_bytes
        buf = self._ffi.new("uint8_t[]", max(n, 1))
        check(self._lib.dfl_context_get_recurrent(self.handle, buf, n))
        return bytes(self._ffi.buffer(buf, n))

    def set_recurrent(self, data: bytes) -> None:
        check(self._lib.dfl_context_set_recurrent(self.handle, self._ffi.from_buffer(data), len(data)))

    def set_n_past(self, n: int) -> None:
        check(self._lib.dfl_context_set_n_past(self.handle, n))

    def state(self) -> bytes:
        """The committed state (KV rows, conv and recurrent states) as bytes."""
        n = self._lib.dfl_context_state_size(self.handle)
        buf = self._ffi.new("uint8_t[]", max(n, 1))
        check(self._lib.dfl_context_get_state(self.handle, buf, n))
        return bytes(self._ffi.buffer(buf, n))

    @property
    def n_forwards(self) -> int:
        return self._lib.dfl_context_n_forwards(self.handle)

    def attach_draft(self, draft: "Draft | None", ring_capacity: int = 4096) -> None:
        p = self._lib.dfl_drafter_default_params()
        p.ring_capacity = ring_capacity
        check(self._lib.dfl_context_attach_draft(self.handle, draft.handle if draft is not None else self._ffi.NULL,
                                                 self._ffi.new("dfl_drafter_params*", p)))
        self.draft = draft  # keep it alive while attached

    def attach_draft_model(self, model: "Model | None") -> None:
        """A qwen35 model of the target's vocabulary drafting chain / DDTree / auto steps (None detaches)."""
        check(self._lib.dfl_context_attach_draft_model(self.handle, model.handle if model is not None else
                                                       self._ffi.NULL))
        self._draft_model_ref = model  # keep it alive while attached

    @property
    def draft_state_bytes(self) -> int:
        return self._lib.dfl_context_draft_state_bytes(self.handle)

    def set_draft_hook(self, fn) -> None:
        """fn(root_pos, root_token, n) -> n draft tokens; None removes the hook (the drafter proposes)."""
        ffi = self._ffi
        if fn is None:
            check(self._lib.dfl_context_set_draft_hook(self.handle, ffi.NULL, ffi.NULL))
            self._hook = None
            return

        def call(user, root_pos, root_token, n, out):
            try:
                toks = [int(t) for t in fn(root_pos, root_token, n)]
                if len(toks) != n:
                    return 1
                for i, t in enumerate(toks):
                    out[i] = t
                return 0
            except Exception:
                return 1

        self._hook = ffi.callback("dfl_draft_hook", call)  # must outlive its use
        check(self._lib.dfl_context_set_draft_hook(self.handle, self._hook, ffi.NULL))

    def set_tree_hook(self, fn) -> None:
        """fn(root_pos, root_token, cap) -> (tokens, parents) of up to cap nodes (parent 0 = root); None removes."""
        ffi = self._ffi
        if fn is None:
            check(self._lib.dfl_context_set_tree_hook(self.handle, ffi.NULL, ffi.NULL))
            self._tree_hook = None
            return

        def call(user, root_pos, root_token, cap, toks_out, par_out):
            try:
                toks, pars = fn(root_pos, root_token, cap)
                if len(toks) != len(pars) or len(toks) > cap:
                    return -1
                for i, (t, p) in enumerate(zip(toks, pars)):
                    toks_out[i], par_out[i] = int(t), int(p)
                return len(toks)
            except Exception:
                return -1

        self._tree_hook = ffi.callback("dfl_tree_hook", call)
        check(self._lib.dfl_context_set_tree_hook(self.handle, self._tree_hook, ffi.NULL))

    def set_topk_hook(self, fn) -> None:
        """Test hook in place of the drafter's ranked output (ddtree and auto steps): fn(root_pos, root_token,
        L, k) -> (ids, logp), each [L][k] (descending per depth).  None removes it."""
        ffi = self._ffi
        if fn is None:
            check(self._lib.dfl_context_set_topk_hook(self.handle, ffi.NULL, ffi.NULL))
            self._topk_hook = None
            return

        def call(user, root_pos, root_token, L, k, ids_out, lp_out):
            try:
                ids, lp = fn(root_pos, root_token, L, k)
                ids = np.asarray(ids, dtype=np.int32).reshape(L, k)
                lp = np.asarray(lp, dtype=np.float32).reshape(L, k)
                ffi.memmove(ids_out, ids.tobytes(), ids.nbytes)
                ffi.memmove(lp_out, lp.tobytes(), lp.nbytes)
                return 0
            except Exception:
                return 1

        self._topk_hook = ffi.callback("dfl_topk_hook", call)
        check(self._lib.dfl_context_set_topk_hook(self.handle, self._topk_hook, ffi.NULL))

    @property
    def has_topk_hook(self) -> bool:
        return getattr(self, "_topk_hook", None) is not None

    def attach_lookup(self, ngram_min: int = 2, ngram_max: int = 4, block: int = 8) -> None:
        """Prompt lookup as the drafter (block <= 0 detaches)."""
        check(self._lib.dfl_context_attach_lookup(self.handle, ngram_min, ngram_max, block))

    def attach_mtp(self, block: int = 4) -> None:
        """The target's own MTP head as a drafter (block <= 0 detaches)."""
        check(self._lib.dfl_context_attach_mtp(self.handle, block))

    def set_constraint(self, c, prune: bool = True) -> None:
        """Structured output (constraint.TokenConstraint): the core asks it for each step's masks and tells it
        the decided tokens.  None removes it.  A callback's exception is kept in c.error."""
        ffi, lib = self._ffi, self._lib
        if c is None:
            check(lib.dfl_context_set_constraint(self.handle, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, 0))
            self._constraint_cbs = None
            return
        words = c.words

        def masks(user, n, tokens, parents, keep, out):
            try:
                t = np.frombuffer(ffi.buffer(tokens, n * 4), np.int32)
                p = np.frombuffer(ffi.buffer(parents, n * 4), np.int32)
                o = np.frombuffer(ffi.buffer(out, n * words * 4), np.uint32).reshape(n, words)
                c.masks(n, t, p, o, keep)
                return 0
            except BaseException as e:  # noqa: BLE001 - reported by the caller of the decode
                c.error = e
                return 1

        def commit(user, n, tokens):
            try:
                c.commit(np.frombuffer(ffi.buffer(tokens, n * 4), np.int32).tolist())
                return 0
            except BaseException as e:  # noqa: BLE001
                c.error = e
                return 1

        def forced(user, cap, out):
            try:
                f = c.forced(cap)
                for i, t in enumerate(f):
                    out[i] = t
                return len(f)
            except BaseException as e:  # noqa: BLE001
                c.error = e
                return -1

        cbs = (ffi.callback("dfl_constraint_masks_fn", masks), ffi.callback("dfl_constraint_commit_fn", commit),
               ffi.callback("dfl_constraint_forced_fn", forced))
        check(lib.dfl_context_set_constraint(self.handle, cbs[0], cbs[1], cbs[2], ffi.NULL, 1 if prune else 0))
        self._constraint_cbs = cbs

    def set_prefill_progress(self, fn) -> None:
        """fn(done, total) after each prefill chunk; a truthy return cancels the prefill.  None removes."""
        ffi = self._ffi
        if fn is None:
            check(self._lib.dfl_context_set_prefill_progress(self.handle, ffi.NULL, ffi.NULL))
            self._progress = None
            return

        def call(user, done, total):
            try:
                return 1 if fn(done, total) else 0
            except Exception:
                return 1

        self._progress = ffi.callback("dfl_progress_fn", call)
        check(self._lib.dfl_context_set_prefill_progress(self.handle, self._progress, ffi.NULL))

    def generate_begin(self, prompt, max_new_tokens: int, ignore_eos: bool, eos_ids, mode: int = 0,
                       block_size: int = 0, tree_budget: int = 22, tree_topk: int = 0,
                       chain_seed: bool = True, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0, seed: int = 0, n_keep: int = 0, n_logprobs: int = -1,
                       penalties: tuple[float, float, float, int] = (1.0, 0.0, 0.0, 64), tree_expand: int = 0) -> None:
        """The raw call, values passed to the core unchecked (tests of the core's own refusals); Decoder uses
        begin() with a validated GenParams.  penalties: (repeat, frequency, presence, repeat_last_n)."""
        rp, fp, pp, rn = penalties
        self._begin(prompt, eos_ids, n_keep, dict(
            max_new_tokens=max_new_tokens, ignore_eos=1 if ignore_eos else 0, mode=mode, block_size=block_size,
            tree_budget=tree_budget, tree_topk=tree_topk, chain_seed=1 if chain_seed else 0, tree_expand=tree_expand,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed & 0xFFFFFFFFFFFFFFFF,
            n_logprobs=n_logprobs, repeat_penalty=rp, frequency_penalty=fp, presence_penalty=pp, repeat_last_n=rn))

    def begin(self, prompt, params, eos_ids, mode: int, block_size: int, n_keep: int = 0) -> None:
        """Starts a decode with a GenParams (params.py) whose seed is resolved; mode and block size as the
        Decoder resolved them.  n_keep: prompt tokens the context already holds (a prefix-cache hit)."""
        self._begin(prompt, eos_ids, n_keep, {**params.c_fields(), "mode": mode, "block_size": block_size},
                    params.logit_bias)

    def _begin(self, prompt, eos_ids, n_keep: int, c_fields: dict, logit_bias: dict | None = None) -> None:
        ffi = self._ffi
        prompt = _i32(prompt)
        if len(prompt) == 0:
            raise DFlashError("empty prompt: give at least one token")
        self._eos = _i32(sorted(eos_ids))
        gp = ffi.new("dfl_gen_params*", self._lib.dfl_gen_default_params())
        gp.n_eos, gp.eos_ids = len(self._eos), self._p(self._eos)
        for k, v in c_fields.items():  # dfl_gen_params members by name
            setattr(gp, k, v)
        if logit_bias:   # (the arrays live on self: the core copies them at begin)
            self._bias = (_i32(list(logit_bias)), np.asarray(list(logit_bias.values()), np.float32))
            gp.n_logit_bias = len(logit_bias)
            gp.logit_bias_ids = self._p(self._bias[0])
            gp.logit_bias_values = ffi.cast("float*", self._bias[1].ctypes.data)
        check(self._lib.dfl_generate_begin_keep(self.handle, self._p(prompt), len(prompt), n_keep, gp))
        self._buf = np.empty(max(256, gp.block_size + 1, gp.tree_budget + 2), np.int32)

    def generate_next(self) -> list[int]:
        n = check(self._lib.dfl_generate_next(self.handle, self._p(self._buf), len(self._buf)))
        return self._buf[:n].tolist()

    @staticmethod
    def generate_next_many(ctxs: "Sequence[Context]") -> list[list[int]]:
        """One step of every slot (contexts sharing a backend), their verify batches in one forward: each
        slot's tokens (an empty list once it is done)."""
        c0 = ctxs[0]
        ffi, lib = c0._ffi, c0._lib
        cap = max(len(c._buf) for c in ctxs)
        handles = ffi.new("dfl_context*[]", [c.handle for c in ctxs])
        out = np.zeros((len(ctxs), cap), np.int32)
        counts = np.zeros(len(ctxs), np.int32)
        check(lib.dfl_generate_next_many(handles, len(ctxs), ffi.cast("int32_t*", out.ctypes.data), cap,
                                         ffi.cast("int32_t*", counts.ctypes.data)))
        return [out[k, :counts[k]].tolist() for k in range(len(ctxs))]

    def logprobs(self, start: int = 0) -> list[dict]:
        """Emitted tokens' log-probabilities from index start: {"token", "logprob", "top": [(id, logprob)]}."""
        lib, out = self._lib, []
        e = self._ffi.new("dfl_token_logprob*")
        for i in range(start, lib.dfl_generate_n_logprobs(self.handle)):
            check(lib.dfl_generate_logprob(self.handle, i, e))
            out.append({"token": e.token, "logprob": e.logprob,
                        "top": [(e.top_ids[k], e.top_logprobs[k]) for k in range(e.n_top)]})
        return out

    def generate_stats(self) -> dict:
        s = self._ffi.new("dfl_gen_stats*")
        check(self._lib.dfl_generate_stats(self.handle, s))
        d = {k: getattr(s, k) for k in ("prompt_tokens", "generated_tokens", "steps", "prefill_s", "decode_s")}
        d["stop_reason"] = _STOP_REASONS.get(s.stop_reason, "unknown")
        return d

    def step_stats(self) -> list[dict]:
        """Per decode step: committed (incl. bonus), drafted, accepted, target_forwards, draft/verify/commit s."""
        lib, out = self._lib, []
        st = self._ffi.new("dfl_step_stats*")
        for i in range(lib.dfl_generate_n_steps(self.handle)):
            check(lib.dfl_generate_step_stats(self.handle, i, st))
            out.append({k: getattr(st, k) for k in ("committed", "drafted", "accepted", "tree_depth",
                                                     "target_forwards", "draft_s", "tree_s", "verify_s", "commit_s",
                                                     "auto_budget", "probe", "expected_tokens", "est_tok_s",
                                                     "est_ar_tok_s", "pruned", "mask_s", "drafter", "declined_learnt",
                                                     "draft_batch", "draft_depth", "merged")})
        return out

    def drafter_names(self) -> list[str]:
        """Auto mode's portfolio, in the core's order of preference (a step's `drafter` indexes it)."""
        out, lib, ffi = [], self._lib, self._ffi
        while (p := lib.dfl_context_drafter_name(self.handle, len(out))) != ffi.NULL:
            out.append(ffi.string(p).decode())
        return out

    def auto_estimates(self, drafter: int = 0) -> dict:
        """What auto mode has learnt for the portfolio's drafter i: costs (s) and the per-depth calibration."""
        e = self._ffi.new("dfl_auto_estimates*")
        check(self._lib.dfl_context_auto_estimates(self.handle, drafter, e))
        return {"ar_s": e.ar_s, "draft_s": e.draft_s, "tree_s": e.tree_s, "commit_s": e.commit_s,
                "verify_s": {e.verify_nodes[i]: e.verify_s[i] for i in range(e.n_verify)},
                "depth_calib": [e.depth_calib[i] for i in range(e.n_calib)],
                "draft_rows_s": {e.draft_rows[i]: e.draft_rows_s[i] for i in range(e.n_draft)},
                "mask_ar_s": e.mask_ar_s, "mask_tree_s": e.mask_tree_s, "constrained": bool(e.constrained)}

    def measure_verify(self, max_nodes: int) -> None:
        """Times verify forwards of 2, 4 .. max_nodes nodes now and gives them to auto mode's estimates."""
        check(self._lib.dfl_context_measure_verify(self.handle, max_nodes))

    def close(self) -> None:
        if getattr(self, "_h", None) is not None:
            self._lib.dfl_context_free(self._h)
            self._h = None

    def __del__(self):
        self.close()


def _info_dict(info) -> dict:
    ffi, _ = load()
    out = {}
    for k in dir(info):
        v = getattr(info, k)
        if isinstance(v, (int, float)):
            out[k] = v
        elif ffi.typeof(v).item.cname == "char":
            out[k] = ffi.string(v).decode("utf-8", "replace")
        else:
            out[k] = list(v)
    return out


def draft_config_info(path) -> dict:
    """A drafter's config.json (the file or its directory) as the core's reader sees it; no weights."""
    ffi, lib = load()
    info = ffi.new("dfl_draft_info*")
    check(lib.dfl_draft_config_info(str(path).encode(), info))
    d = _info_dict(info)
    d["target_layer_ids"] = d["target_layer_ids"][:d["n_target_layers"]]
    return d


class Draft:
    """A loaded DFlash drafter (config.json + model.safetensors), validated against `target` when given."""

    AS_STORED = 0xFFFFFFFF

    def __init__(self, path: str, target: Model | None = None, weight_type: str | None = None):
        """weight_type: None keeps the file's type; "bf16" / "q8_0" converts the matrices at load."""
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        if weight_type not in (None, "bf16", "q8_0"):
            raise DFlashError(f"drafter weight type {weight_type!r}: choose bf16 or q8_0 (or keep the file's)")
        wt = self.AS_STORED if weight_type is None else TYPE_IDS[weight_type]
        h = lib.dfl_draft_load_as(str(path).encode(), target.handle if target is not None else ffi.NULL, wt)
        if h == ffi.NULL:
            raise DFlashError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
        self._h = h
        info = ffi.new("dfl_draft_info*")
        check(lib.dfl_draft_get_info(h, info))
        d = _info_dict(info)
        d["target_layer_ids"] = d["target_layer_ids"][:d["n_target_layers"]]
        self.info = d
        self.path = str(path)

    @property
    def handle(self):
        if self._h is None:
            raise DFlashError("draft is closed")
        return self._h

    def close(self) -> None:
        if getattr(self, "_h", None) is not None:
            self._lib.dfl_draft_free(self._h)
            self._h = None

    def __del__(self):
        self.close()


class Drafter:
    """A standalone drafter runtime (feature ring + draft KV cache) for tests and tools."""

    def __init__(self, draft: Draft, target: Model, ring_capacity: int = 4096, n_threads: int = 0):
        ffi, lib = draft._ffi, draft._lib
        self._ffi, self._lib, self.draft, self.target = ffi, lib, draft, target
        p = lib.dfl_drafter_default_params()
        p.ring_capacity, p.n_threads = ring_capacity, n_threads
        h = lib.dfl_drafter_new(draft.handle, target.handle, ffi.new("dfl_drafter_params*", p))
        if h == ffi.NULL:
            raise DFlashError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
        self._h = h
        self.n_vocab = target.info["n_vocab"]

    @property
    def n_pos(self) -> int:
        return self._lib.dfl_drafter_n_pos(self._h)

    def reset(self) -> None:
        check(self._lib.dfl_drafter_reset(self._h))

    def push_features(self, features: np.ndarray, pos0: int | None = None) -> None:
        f = np.ascontiguousarray(features, dtype=np.float32)
        f = f.reshape(f.shape[0], -1)
        check(self._lib.dfl_drafter_push_features(self._h, self.n_pos if pos0 is None else pos0, f.shape[0],
                                                  self._ffi.cast("float*", f.ctypes.data)))

    def propose(self, block_tokens) -> np.ndarray:
        """float32 [len(block_tokens)-1, vocab]: draft logits of block positions 1.."""
        b = _i32(block_tokens)
        out = np.empty((max(len(b) - 1, 1), self.n_vocab), np.float32)
        check(self._lib.dfl_drafter_propose(self._h, len(b), self._ffi.cast("int32_t*", b.ctypes.data),
                                            self._ffi.cast("float*", out.ctypes.data)))
        return out

    def propose_path(self, block_tokens, top_k: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """DFlash2: the candidate selector's chain, and each position's top_k candidates (ids, log-probs)."""
        b = _i32(block_tokens)
        path = np.empty(max(len(b) - 1, 1), np.int32)
        ids = np.empty((max(len(b) - 1, 1), top_k), np.int32)
        lp = np.empty((max(len(b) - 1, 1), top_k), np.float32)
        ffi = self._ffi
        check(self._lib.dfl_drafter_propose_path(self._h, len(b), ffi.cast("int32_t*", b.ctypes.data),
                                                 ffi.cast("int32_t*", path.ctypes.data),
                                                 ffi.cast("int32_t*", ids.ctypes.data),
                                                 ffi.cast("float*", lp.ctypes.data)))
        return path.tolist(), ids, lp

    def propose_lattice(self, block_tokens, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """DFlash2: the selector's lattice: candidates (ids, log-probs [B-1, K]) and edge scores [B-1, K, K]."""
        b = _i32(block_tokens)
        n = max(len(b) - 1, 1)
        ids, lp = np.empty((n, top_k), np.int32), np.empty((n, top_k), np.float32)
        edge = np.empty((n, top_k, top_k), np.float32)
        ffi = self._ffi
        check(self._lib.dfl_drafter_propose_lattice(self._h, len(b), ffi.cast("int32_t*", b.ctypes.data),
                                                    ffi.cast("int32_t*", ids.ctypes.data),
                                                    ffi.cast("float*", lp.ctypes.data),
                                                    ffi.cast("float*", edge.ctypes.data)))
        return ids, lp, edge

    def close(self) -> None:
        if getattr(self, "_h", None) is not None:
            self._lib.dfl_drafter_free(self._h)
            self._h = None

    def __del__(self):
        self.close()
