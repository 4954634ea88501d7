"""Prompt lookup's tree joined to the tree of the drafter that drafts the step (csrc/spec/tree_merge.cpp, auto
mode's portfolio): the union of two trees, each node's acceptance its own drafter's estimate, siblings sharing
their parent's chance, best-first with parents first; and a portfolio whose model drafter is right only near
the root committing lookup's longer continuation in one verify, output == AR."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError
from dflash27b._lib import check, load
from dflash27b.tools.oracle_draft import NearRootOracle as NearRoot


def merge(a, b, cap=64):
    """a, b: lists of (token, parent, q), parent 0 = the root.  Returns the union's nodes as
    (token, depth, parent, q, from_a, from_b)."""
    ffi, lib = load()

    def arrays(t):
        tok = np.array([x[0] for x in t], np.int32)
        par = np.array([x[1] for x in t], np.int32)
        q = np.array([x[2] for x in t], np.float64)
        return tok, par, q

    (at, ap, aq), (bt, bp, bq) = arrays(a), arrays(b)
    out = [np.zeros(cap, np.int32) for _ in range(3)] + [np.zeros(cap, np.float64)] + \
          [np.zeros(cap, np.int32) for _ in range(2)]
    i32 = lambda x: ffi.cast("int32_t*", x.ctypes.data)   # noqa: E731
    f64 = lambda x: ffi.cast("double*", x.ctypes.data)    # noqa: E731
    n = check(lib.dfl_merge_trees(len(a), i32(at), i32(ap), f64(aq), len(b), i32(bt), i32(bp), f64(bq), cap,
                                  i32(out[0]), i32(out[1]), i32(out[2]), f64(out[3]), i32(out[4]), i32(out[5])))
    return [tuple(x[i].item() for x in out) for i in range(n)]


def paths(nodes, tok_at=0, par_at=1):
    """Each node's token path from the root (node i+1's parent is nodes[i][par_at], 0 = the root)."""
    out = []
    for i in range(len(nodes)):
        p, j = [], i + 1
        while j:
            p.append(nodes[j - 1][tok_at])
            j = nodes[j - 1][par_at]
        out.append(tuple(reversed(p)))
    return out


def test_the_union_of_two_small_trees():
    # a: 10 (0.6) -> 20 (0.5), and 11 (0.2); b: 10 (0.8) -> 21 (0.7) -> 30 (0.7)
    a = [(10, 0, 0.6), (11, 0, 0.2), (20, 1, 0.5)]
    b = [(10, 0, 0.8), (21, 1, 0.7), (30, 2, 0.7)]
    u = merge(a, b)
    # 10 is one node with the larger chance; its children 20 and 21 claim 1.2 of its 0.8: scaled by 2/3;
    # 30 may claim no more than its parent 21 has left (0.7 * 2/3)
    want = [(10, 1, 0, 0.8, 1, 1), (21, 2, 1, 0.7 * 0.8 / 1.2, 0, 2), (30, 3, 2, 0.7 * 0.8 / 1.2, 0, 3),
            (20, 2, 1, 0.5 * 0.8 / 1.2, 3, 0), (11, 1, 0, 0.2, 2, 0)]
    assert [x[:3] + x[4:] for x in u] == [x[:3] + x[4:] for x in want]
    assert [x[3] for x in u] == pytest.approx([x[3] for x in want], abs=1e-12)


def test_a_tree_merged_with_nothing_is_itself_in_its_own_order():
    a = [(5, 0, 0.9), (6, 1, 0.5), (7, 0, 0.05), (8, 2, 0.4)]
    u = merge(a, [])
    assert [(x[0], x[2], x[4], x[5]) for x in u] == [(5, 0, 1, 0), (6, 1, 2, 0), (8, 2, 4, 0), (7, 0, 3, 0)]


def random_tree(rng, n, vocab=4, depth_max=6):
    t = []
    for i in range(1, n + 1):
        p = rng.randrange(0, i)
        d = 1
        j = p
        while j:
            d += 1
            j = t[j - 1][1]
        if d > depth_max:
            p = 0
        t.append((rng.randrange(vocab), p, rng.random()))
    # a tree may hold a path twice (two children with one token): keep the first, as a drafter's tree does
    seen, keep, index = set(), [], {0: 0}
    for i, (tok, p, q) in enumerate(t, 1):
        if p not in index:
            continue
        key = (index[p], tok)
        if key in seen:
            continue
        seen.add(key)
        keep.append((tok, index[p], q))
        index[i] = len(keep)
    return keep


def test_the_union_keeps_every_path_once_best_first():
    rng = random.Random(7)
    for _ in range(200):
        a, b = random_tree(rng, rng.randrange(0, 12)), random_tree(rng, rng.randrange(0, 12))
        u = merge(a, b)
        pa, pb, pu = paths(a), paths(b), paths(u, 0, 2)
        assert sorted(pu) == sorted(set(pa) | set(pb))               # every path of either, once
        for i, (tok, depth, par, q, ia, ib) in enumerate(u, 1):
            assert 0 <= par < i and depth == len(pu[i - 1])            # parents first
            assert (ia and pa[ia - 1] == pu[i - 1]) or (not ia and pu[i - 1] not in pa)
            assert (ib and pb[ib - 1] == pu[i - 1]) or (not ib and pu[i - 1] not in pb)
            own = max(a[ia - 1][2] if ia else 0.0, b[ib - 1][2] if ib else 0.0)
            assert 0 <= q <= own + 1e-12                              # scaled down only
        for i in range(len(u) + 1):                                   # siblings share their parent's chance
            parent_q = 1.0 if i == 0 else u[i - 1][3]
            assert sum(x[3] for x in u if x[2] == i) <= parent_q + 1e-9
        assert all(u[i][3] >= u[i + 1][3] for i in range(len(u) - 1))  # best-first


@pytest.mark.parametrize("a, b, message", [
    ([(1, 1, 0.5)], [], "tree a: node 1 has parent 1"),
    ([], [(1, 0, 0.5), (2, 3, 0.5)], "tree b: node 2 has parent 3"),
    ([(1, 0, 1.5)], [], r"tree a: node 1's q 1.5 is outside \[0, 1\]"),
])
def test_bad_trees_are_refused(a, b, message):
    with pytest.raises(DFlashError, match=message):
        merge(a, b)


SRC = open(os.path.join(os.path.dirname(__file__), "..", "python", "dflash27b", "results.py")).read()[:1500]
EDIT = f"# results.py\n{SRC}\n\n# results.py, with the edit applied:\n{SRC[:700]}"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.3, "seed": 11}], ids=["greedy", "seeded"])
def test_lookup_extends_the_chosen_drafters_tree(sampling):
    """The hook drafter wins every step (2 depths right, cheap enough); lookup, which drafts nothing on its own
    while the hook's bets win, adds its continuation of the edited file to the hook's tree where it is priced
    to pay, and greedy steps then commit past the hook's 2 depths (the tiny target's greedy reply repeats its
    lines; a sampled one seldom does, so there only the output and the records are checked).  Which steps
    merge depends on the costs measured as the requests run (and, under a parallel test run, on what else the
    cores are doing), so up to eight requests run until one commits past them."""
    right = 2
    with Decoder(draft="lookup", threads=2) as d:
        ar = d.generate(EDIT, 128, mode="ar", ignore_eos=True, cache=False, **sampling)
        d._ctx.set_topk_hook(NearRoot(list(ar.prompt_tokens) + ar.tokens, d.info["n_vocab"], right))
        assert d._ctx.drafter_names() == ["top-k hook", "lookup"]
        beyond = False
        for _ in range(8):
            r = d.generate(EDIT, 128, mode="auto", ignore_eos=True, cache=False, **sampling)
            assert r.tokens == ar.tokens
            st = d._ctx.step_stats()
            merged = [s for s in st if s["merged"] > 0]
            assert all(s["drafter"] == 0 and 0 < s["merged"] <= s["auto_budget"] for s in merged)
            assert len(r.stats.merged) == r.stats.steps
            beyond |= any(s["committed"] > right + 1 for s in merged)
            if merged:
                assert "with lookup's nodes added" in r.stats.auto_summary
            if beyond:
                break
        assert beyond or sampling, "no step committed lookup's nodes past the hook's depths"
        # without lookup, nothing is merged
        d._ctx.attach_lookup(block=0)
        r = d.generate(EDIT, 48, mode="auto", ignore_eos=True, cache=False, **sampling)
        assert r.tokens == ar.tokens[:48] and not any(r.stats.merged)



GRAMMAR = 'root ::= [a-zA-Z_ .,:()=\\n#"]{1,600}'
REPEAT = "import os\nimport sys\n" * 3 + "import os\nimport"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "seed": 5}], ids=["greedy", "seeded"])
def test_under_a_grammar(sampling):
    """Under a grammar the union goes through the constraint's forced chain and pruning like any tree, its nodes
    keeping their drafter (DraftTree::tag); the output is the constrained AR's.  (On this CPU a constraint's
    masks make trees dear, so the hook drafts few steps: the hook first learns its costs on a plain request.)"""
    with Decoder(draft="lookup", threads=2) as d:
        plain = d.generate(REPEAT, 96, mode="ar", cache=False, **sampling)
        ar = d.generate(REPEAT, 96, mode="ar", grammar=GRAMMAR, cache=False, **sampling)
        hook = NearRoot(list(plain.prompt_tokens) + plain.tokens, d.info["n_vocab"], 2)
        d._ctx.set_topk_hook(hook)
        assert d.generate(REPEAT, 96, mode="auto", cache=False, **sampling).tokens == plain.tokens
        hook.seq = list(ar.prompt_tokens) + ar.tokens
        for _ in range(2):
            r = d.generate(REPEAT, 96, mode="auto", grammar=GRAMMAR, cache=False, **sampling)
            assert r.tokens == ar.tokens
            assert all(s["drafter"] == 0 and s["merged"] <= s["auto_budget"] for s in d._ctx.step_stats() if s["merged"])
