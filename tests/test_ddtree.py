"""DDTree: tree construction (vs brute force), tree forward (== chain along each root path), lossless
decoding for every budget, injected trees of any shape with state == AR after each commit."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder
from dflash27b._lib import DFlashError, check, load
from spec_steps import run_checking_state
from tiny_draft import make_tiny_draft

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
N_NEW = 256


def build(logits: np.ndarray, budget: int, topk: int = 0, chain_seed: bool = False):
    ffi, lib = load()
    lg = np.ascontiguousarray(logits, np.float32)
    L, V = lg.shape
    cap = max(budget, 1)
    tok, dep, par = (np.zeros(cap, np.int32) for _ in range(3))
    n = check(lib.dfl_build_ddtree(ffi.cast("float*", lg.ctypes.data), L, V, budget, topk, int(chain_seed), cap,
                                   ffi.cast("int32_t*", tok.ctypes.data), ffi.cast("int32_t*", dep.ctypes.data),
                                   ffi.cast("int32_t*", par.ctypes.data)))
    return tok[:n].tolist(), dep[:n].tolist(), par[:n].tolist()


def paths(tok, par):
    """Each node's token path from the root (node i+1 has parent par[i], 0 = root)."""
    out = []
    for i in range(len(tok)):
        p, j = [], i + 1
        while j:
            p.append(tok[j - 1])
            j = par[j - 1]
        out.append(tuple(reversed(p)))
    return out


def log_softmax(x):
    x = x.astype(np.float64)
    return x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 7, 12, 30])
def test_tree_is_the_most_probable_prefixes(seed, budget):
    L, V = 4, 5
    lg = np.random.default_rng(seed).standard_normal((L, V)).astype(np.float32) * 2
    tok, dep, par = build(lg, budget, topk=V)
    assert all(p < i + 1 for i, p in enumerate(par))                      # topological
    assert all(dep[i] == (dep[p - 1] + 1 if p else 1) for i, p in enumerate(par))
    lp = log_softmax(lg)
    everything = [pre for d in range(1, L + 1) for pre in itertools.product(range(V), repeat=d)]
    score = {pre: sum(lp[k, t] for k, t in enumerate(pre)) for pre in everything}
    want = set(sorted(everything, key=lambda q: -score[q])[:budget])
    assert set(paths(tok, par)) == want
    assert len(tok) == min(budget, len(everything))


@pytest.mark.parametrize("seed", range(4))
def test_chain_seed_contains_the_greedy_chain(seed):
    L, V = 6, 50
    lg = np.random.default_rng(seed).standard_normal((L, V)).astype(np.float32)
    greedy = tuple(int(np.argmax(r)) for r in lg)
    for budget in (3, 6, 10, 22):
        tok, dep, par = build(lg, budget, chain_seed=True)
        ps = paths(tok, par)
        assert ps[: min(budget, L)] == [greedy[:d] for d in range(1, min(budget, L) + 1)]
        assert len(set(ps)) == len(ps) == budget and all(p < i + 1 for i, p in enumerate(par))


def test_topk_limits_the_width_and_ties_are_deterministic():
    lg = np.zeros((3, 10), np.float32)  # every token ties
    a = build(lg, 8, topk=2)
    assert a == build(lg, 8, topk=2)
    assert all(t in (0, 1) for t in a[0])  # lower ids first on ties
    assert build(lg, 0)[0] == []


# ---------------------------------------------------------------- tree forward


@pytest.mark.parametrize("kind", ["f32", "q4_k_m"])
def test_random_tree_node_logits_equal_their_chain(kind, tiny_f32_gguf, synth_gguf):
    model = tiny_f32_gguf if kind == "f32" else synth_gguf("q4_k_m")
    rng = np.random.default_rng(3)
    with Decoder(model, kv_type="q4_0", ctx=256, threads=2) as d:
        ctx = d.context
        prefix = rng.integers(0, 2000, 9).tolist()
        for trial in range(3):
            n = 12
            par = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
            toks = rng.integers(0, 2000, n).tolist()
            depth = [0] * n
            for i in range(1, n):
                depth[i] = depth[par[i]] + 1
            ctx.reset()
            ctx.forward(prefix, logit_rows=[])
            pos = [len(prefix) + x for x in depth]
            lg, _ = ctx.forward(toks, pos=pos, parent=par, commit=False)
            for i in range(n):
                chain = []
                j = i
                while j >= 0:
                    chain.append(toks[j])
                    j = par[j]
                chain.reverse()
                ctx.reset()
                ctx.forward(prefix, logit_rows=[])
                want, _ = ctx.forward(chain, logit_rows=[len(chain) - 1])
                assert np.array_equal(lg[i], want[0]), f"trial {trial} node {i}"


# ---------------------------------------------------------------- lossless decoding


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("rdraft_tree"), n_layers=1, block_size=16, seed=9)


@pytest.fixture(scope="module")
def ar_ref(ar_tokens):
    return lambda prompt, kv: ar_tokens(prompt, kv, N_NEW)


TRAIN_PROMPT = tuple(np.random.default_rng(0).integers(0, 2047, 16).tolist())


@pytest.mark.parametrize("kv", ["f32", "q4_0"])
@pytest.mark.parametrize("budget", [1, 4, 16, 22, 32])
@pytest.mark.parametrize("drafter", ["random", "distilled"])
def test_ddtree_equals_ar(tiny_f32_gguf, random_draft, ar_ref, drafter, budget, kv):
    path = DISTILLED if drafter == "distilled" else random_draft
    with Decoder(tiny_f32_gguf, path, kv_type=kv, ctx=1024, threads=2) as d:
        r = d.generate(list(TRAIN_PROMPT), N_NEW, ignore_eos=True, mode="ddtree", budget=budget)
    s = r.stats
    assert s.mode == "ddtree" and s.budget == budget
    assert r.tokens == ar_ref(TRAIN_PROMPT, kv)
    assert s.target_forwards == [1] * s.steps
    assert all(n <= budget for n in s.tree_size) and sum(s.accept_lengths) + 1 == N_NEW
    if drafter == "distilled" and kv == "f32" and budget >= 4:
        assert sum(a - 1 for a in s.accept_lengths) >= 50  # the learned stretch comes as accepted drafts


def teacher_tree(full: list[int], shape: str, vocab: int, rng: np.random.Generator):
    """Trees holding the reference continuation somewhere (or not at all), in several shapes."""

    def hook(root_pos, root_token, cap):
        assert full[root_pos] == root_token
        ref = full[root_pos + 1: root_pos + 1 + 12]
        wrong = lambda t: (t + 1 + int(rng.integers(0, vocab - 1))) % vocab  # never equals t  # noqa: E731
        if shape == "single":
            return [ref[0] if rng.random() < 0.5 else wrong(ref[0])], [0]
        if shape == "wide":  # the root's children only, the right one at a random slot
            k = min(cap, 10)
            toks = [wrong(ref[0]) for _ in range(k)]
            if rng.random() < 0.8:
                toks[int(rng.integers(0, k))] = ref[0]
            return toks, [0] * k
        # deep: a wrong branch first, then the reference path cut at a random depth, then a decoy child
        toks, pars = [wrong(ref[0])], [0]
        depth = int(rng.integers(0, min(len(ref), cap - 2) + 1))
        prev = 0
        for k in range(depth):
            toks.append(ref[k])
            pars.append(prev)
            prev = len(toks)
        toks.append(wrong(ref[depth]) if depth < len(ref) else 0)
        pars.append(prev)
        return toks, pars

    return hook


@pytest.mark.parametrize("shape", ["single", "wide", "deep"])
@pytest.mark.parametrize("kv", ["f32", "q4_0"])
def test_injected_trees_state_equals_ar(tiny_f32_gguf, ar_ref, shape, kv):
    prompt = (5, 9, 13, 17, 21)
    n_new = 80
    ref = ar_ref(prompt, kv)[:n_new]
    full = list(prompt) + ref + [0] * 16
    with Decoder(tiny_f32_gguf, kv_type=kv, ctx=512, threads=2) as sp, \
            Decoder(tiny_f32_gguf, kv_type=kv, ctx=512, threads=2) as ar:
        ctx = sp.context
        ctx.set_tree_hook(teacher_tree(full, shape, 2048, np.random.default_rng(1)))
        ctx.generate_begin(list(prompt), n_new, True, [], mode=2, tree_budget=16)
        out, accepted = run_checking_state(ctx, ar.context, full)
        assert out == ref
        assert len(accepted) > 1 or shape == "single"


def test_ddtree_errors(tiny_f32_gguf, random_draft):
    with Decoder(tiny_f32_gguf, threads=1) as d:
        with pytest.raises(DFlashError, match="needs a drafter"):
            d.generate([1, 2], 4, mode="ddtree")
    with Decoder(tiny_f32_gguf, random_draft, threads=1, batch=16) as d:
        with pytest.raises(DFlashError, match="exceeds the context's batch size"):
            d.generate([1, 2], 4, mode="ddtree", budget=22)
        with pytest.raises(DFlashError, match="must be >= 0"):
            d.generate([1, 2], 4, mode="ddtree", budget=-1)
        assert d.generate([1, 2], 4, mode="ddtree", budget=0).stats.accept_lengths == [1, 1, 1]
        with pytest.raises(DFlashError, match="tree_scores"):
            d.generate([1, 2], 4, mode="ddtree", tree_scores="beam")
        with pytest.raises(DFlashError, match="tree_scores must be 0"):  # the core refuses a raw value too
            d.context._begin([1, 2], [], 0, {"mode": 2, "max_new_tokens": 4, "tree_scores": 7})
