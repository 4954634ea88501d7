"""Owning wrappers for the core's handles: one class per C handle.

Each frees its handle exactly once (close() or garbage collection) and keeps
the objects it depends on alive (a Context holds its Model).  Arrays cross the
ABI as numpy buffers; nothing is parsed from text.
"""
from __future__ import annotations

import numpy as np

from ._lib import DFlashError, check, load

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


class Context:
    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_threads: int, kv_type: int):
        ffi, lib = model._ffi, model._lib
        self._ffi, self._lib, self.model = ffi, lib, model
        p = lib.dfl_context_default_params()
        p.n_ctx, p.n_batch, p.n_threads, p.kv_type = n_ctx, n_batch, n_threads, kv_type
        h = lib.dfl_context_new(model.handle, ffi.new("dfl_context_params*", p))
        if h == ffi.NULL:
            raise DFlashError(ffi.string(lib.dfl_last_error()).decode("utf-8", "replace"))
        self._h = h
        self.n_vocab = model.info["n_vocab"]
        self.n_embd = model.info["n_embd"]

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

    def generate_begin(self, prompt, max_new_tokens: int, ignore_eos: bool, eos_ids) -> None:
        ffi = self._ffi
        prompt = _i32(prompt)
        if len(prompt) == 0:
            raise DFlashError("empty prompt: give at least one token")
        self._eos = _i32(sorted(eos_ids))
        gp = ffi.new("dfl_gen_params*")
        gp.max_new_tokens, gp.ignore_eos = max_new_tokens, 1 if ignore_eos else 0
        gp.n_eos, gp.eos_ids = len(self._eos), self._p(self._eos)
        check(self._lib.dfl_generate_begin(self.handle, self._p(prompt), len(prompt), gp))
        self._buf = np.empty(256, np.int32)

    def generate_next(self) -> list[int]:
        n = check(self._lib.dfl_generate_next(self.handle, self._p(self._buf), len(self._buf)))
        return self._buf[:n].tolist()

    def generate_stats(self) -> dict:
        s = self._ffi.new("dfl_gen_stats*")
        check(self._lib.dfl_generate_stats(self.handle, s))
        d = {k: getattr(s, k) for k in ("prompt_tokens", "generated_tokens", "steps", "prefill_s", "decode_s")}
        d["stop_reason"] = _STOP_REASONS.get(s.stop_reason, "unknown")
        return d

    def close(self) -> None:
        if getattr(self, "_h", None) is not None:
            self._lib.dfl_context_free(self._h)
            self._h = None

    def __del__(self):
        self.close()
