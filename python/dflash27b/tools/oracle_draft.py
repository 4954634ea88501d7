"""A test-only oracle drafter: it proposes the target's known continuation.

Plugged in through the context's top-k hook (in place of the drafter's ranked output), it makes the case
where speculation must win reproducible on any device: at the block rooted at position s, depth d ranks
first the token the target's own AR decode put at position s + d (probability `p_top`), then other ids.
Every verified choice is still the target's, so the output stays AR's whatever the oracle says.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np


class OracleDrafter:
    def __init__(self, sequence: Sequence[int], n_vocab: int, p_top: float = 0.99):
        """sequence: prompt + the target's AR continuation (absolute positions 0..)."""
        self.seq = [int(t) for t in sequence]
        self.n_vocab = int(n_vocab)
        self.lp_top = math.log(p_top)
        self.lp_rest = math.log((1.0 - p_top) / 8)

    def __call__(self, root_pos: int, root_token: int, L: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.empty((L, k), dtype=np.int32)
        lp = np.full((L, k), self.lp_rest - 1.0, dtype=np.float32)
        for d in range(1, L + 1):
            p = root_pos + d
            known = p < len(self.seq)
            top = self.seq[p] if known else 0
            ids[d - 1] = (top + np.arange(k)) % self.n_vocab  # distinct ids, the known one first
            lp[d - 1, 0] = self.lp_top if known else self.lp_rest
            lp[d - 1, 1:] = self.lp_rest - 1.0
        return ids, lp


class NearRootOracle:
    """An oracle that knows only the first `right` tokens of each block (probability 0.95) and guesses a wrong
    token below them with less confidence (0.3), taking `wait` seconds a draft (busy: a sleep on a busy machine
    takes milliseconds): a stand-in for a model drafter whose first tokens are good and whose forward costs a
    fraction of an AR step (the lookup union's tests and bench/tree_merge_cpu.py).  `seq`: prompt + the target's
    AR continuation, settable between requests."""

    def __init__(self, seq: Sequence[int], n_vocab: int, right: int = 2, wait: float = 2e-4):
        self.seq, self.V, self.right, self.wait = list(seq), int(n_vocab), int(right), float(wait)

    def __call__(self, root_pos: int, root_token: int, L: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        ids = np.empty((L, k), dtype=np.int32)
        lp = np.full((L, k), -6.0, dtype=np.float32)
        for d in range(1, L + 1):
            p = root_pos + d
            top = self.seq[p] if p < len(self.seq) else 0
            if d > self.right:
                top = (top + 7) % self.V
            ids[d - 1] = (top + np.arange(k)) % self.V
            lp[d - 1, 0] = math.log(0.95 if d <= self.right else 0.3)
        while time.perf_counter() - t0 < self.wait:
            pass
        return ids, lp


def attach_oracle(decoder, prompt: Sequence[int], continuation: Sequence[int], p_top: float = 0.99) -> OracleDrafter:
    """Installs the oracle on a Decoder's context (modes ddtree and auto then draft from it)."""
    oracle = OracleDrafter(list(prompt) + list(continuation), decoder.info["n_vocab"], p_top)
    decoder._ctx.set_topk_hook(oracle)
    return oracle
