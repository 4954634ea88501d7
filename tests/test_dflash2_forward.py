"""DFlash2 drafter forward and candidate-selector path against the independent PyTorch reference
(tests/dflash2_ref.py, written from docs/research/dflash2-spec.md and cross-checked there against z-lab's own
DFlash2 code): F32 weights, same features and block, logits within 1e-4 and the same selected path, across
two draft calls (the second sees context K/V the first computed) and with strong convolutions and selector."""
from __future__ import annotations


import numpy as np
import pytest

from tiny_draft import make_tiny_draft, to_dflash2

pytestmark = pytest.mark.oracle
torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from dflash2_ref import load_dflash2  # noqa: E402


@pytest.fixture(scope="module")
def target_pair(tiny_hf_dir, tiny_f32_gguf):
    from transformers import AutoModelForCausalLM

    from dflash27b import _handles
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    return hf, _handles.Model(str(tiny_f32_gguf))


CASES = {
    "mild": dict(scale=0.05, seed=1),
    "strong": dict(scale=0.5, seed=2),
    "three taps, multiplier": dict(scale=0.3, seed=3, conv_kernel_size=3, output_multiplier=0.5),
    "sliding, non-causal": dict(scale=0.3, seed=4, v1=dict(layer_types=["sliding_attention", "sliding_attention"],
                                                           sliding_window=6, use_sliding_window=True,
                                                           is_causal=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_selector_path_match_the_reference(case, target_pair, tmp_path):
    from dflash27b import _handles
    hf, target = target_pair
    kw = dict(CASES[case])
    v1 = make_tiny_draft(tmp_path / "v1", n_layers=2, block_size=8, dtype="f32", seed=7, **kw.pop("v1", {}))
    d = to_dflash2(v1, tmp_path / "d2", **kw)
    ref = load_dflash2(d)
    E = hf.model.embed_tokens.weight.detach().double()
    head = hf.lm_head.weight.detach().double()
    draft = _handles.Draft(str(d), target)
    B, mask, K = draft.info["block_size"], draft.info["mask_token_id"], draft.info["selector_top_k"]
    width = draft.info["hidden"] * draft.info["n_target_layers"]
    rng = np.random.default_rng(5)
    dr = _handles.Drafter(draft, target, ring_capacity=4096, n_threads=2)
    ctx, n_ctx = None, 0
    for n_new, root in ((20, 17), (5, 901)):
        f = rng.standard_normal((n_new, width)).astype(np.float32)
        dr.push_features(f)
        new = ref.context_kv(torch.from_numpy(f).double(), start=n_ctx)
        ctx = new if ctx is None else ctx.extend(new)
        n_ctx += n_new
        block = [root] + [mask] * (B - 1)
        out = ref.block_forward(ctx, block, n_ctx, E, head)
        got = dr.propose(block)
        err = float(np.abs(got - out.logits.numpy()).max())
        assert err < 1e-4, err
        path, ids, _ = dr.propose_path(block, K)
        want = ref.greedy_path(root, out.logits, out.hidden, out.raw_logits)
        assert ids.tolist() == want.cand_ids.tolist()
        assert path == want.tokens, (path, want.tokens)
        # the whole lattice: every predecessor -> candidate transition term (the engine's unary is the
        # log-prob, the oracle's the logit: they differ by a row constant, so the bilinear terms are compared)
        lids, llp, edge = dr.propose_lattice(block, K)
        assert lids.tolist() == want.cand_ids.tolist()
        lat = ref.selector_lattice(root, want.cand_ids, out.hidden, want.unary)
        bilinear = (lat - want.unary[:, None, :]).numpy()
        got_bi = edge - llp[:, None, :]
        assert np.abs(got_bi - bilinear).max() <= 1e-4 * max(1.0, np.abs(bilinear).max())


def test_chain_decode_equals_zlab_dflash2_loop(tiny_hf_dir, tiny_f32_gguf, tmp_path, monkeypatch):
    """z-lab's own decode loop (dflash_generate) with its DFlash2DraftModel, on the exact target, against ours in
    chain mode with the same checkpoint: the same tokens and the same per-step acceptance lengths.  The drafter
    is the distilled tiny one with light convolutions and a selector added, so it still accepts several tokens."""
    import shutil

    zl = pytest.importorskip("dflash.model")
    if not hasattr(zl, "DFlash2DraftModel"):
        pytest.skip("this dflash package has no DFlash2DraftModel")
    from transformers import AutoModelForCausalLM

    from dflash27b import Decoder
    from test_zlab_generate import DISTILLED, training_prompts
    from zlab_ref import ExactTarget, zlab_loop_on_cpu
    zlab_loop_on_cpu(monkeypatch)
    v1 = tmp_path / "v1"
    shutil.copytree(DISTILLED, v1)
    w = load_file(str(v1 / "model.safetensors"))
    save_file({k: v.float().contiguous() for k, v in w.items()}, str(v1 / "model.safetensors"))
    d = to_dflash2(v1, tmp_path / "d2", scale=0.02, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_hf_dir), dtype=torch.float32).eval()
    draft = zl.DFlash2DraftModel.from_pretrained(str(d), dtype=torch.float32).eval()
    target = ExactTarget(hf)
    n_new, block = 48, 8
    with Decoder(tiny_f32_gguf, d, kv_type="f32", threads=2) as dec:
        for prompt in training_prompts(2):
            ref = zl.dflash_generate(draft, target, torch.tensor([prompt]), n_new, None, block_size=block,
                                     return_stats=True)
            got = dec.generate(prompt, n_new, ignore_eos=True, mode="chain", block_size=block)
            assert got.tokens == ref.output_ids[0, len(prompt):].tolist()
            assert got.stats.accept_lengths == ref.acceptance_lengths
            assert got.stats.mean_accept > 1.5


def reference_lattice_tree(ids, lp, edge, budget):
    """Independent of the engine's builder: the `budget` most probable prefixes, a child's log-prob being its
    depth's draft mass shared out by the softmax of its parent's edge row (float64, every prefix scored)."""
    import heapq
    L, K = ids.shape
    mass = np.log(np.exp(lp.astype(np.float64)).sum(1))

    def child_lp(t, i):
        e = edge[t, 0 if t == 0 else i].astype(np.float64)
        return e - (e.max() + np.log(np.exp(e - e.max()).sum())) + mass[t]

    heap = [(-c, (j,)) for j, c in enumerate(child_lp(0, 0))]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append((tuple(int(ids[t, j]) for t, j in enumerate(path)), -neg))
        t = len(path)
        if t < L:
            for j, c in enumerate(child_lp(t, path[-1])):
                heapq.heappush(heap, (neg - c, path + (j,)))
    return chosen


def engine_lattice_tree(ids, lp, edge, budget, chain_seed):
    from dflash27b._lib import check, load
    ffi, lib = load()
    L, K = ids.shape
    tok, dep, par = (np.empty(budget, np.int32) for _ in range(3))
    logp = np.empty(budget, np.float32)
    c = lambda a, t: ffi.cast(t, a.ctypes.data)  # noqa: E731
    n = check(lib.dfl_build_ddtree_lattice(c(np.ascontiguousarray(ids, np.int32), "int32_t*"),
                                           c(np.ascontiguousarray(lp, np.float32), "float*"),
                                           c(np.ascontiguousarray(edge, np.float32), "float*"), L, K, budget,
                                           int(chain_seed), budget, c(tok, "int32_t*"), c(dep, "int32_t*"),
                                           c(par, "int32_t*"), c(logp, "float*")))
    paths = []
    for i in range(n):  # each node's token path from the root
        p, j = [], i + 1
        while j:
            p.append(int(tok[j - 1]))
            j = int(par[j - 1])
        paths.append(tuple(reversed(p)))
    return paths, dep[:n].tolist(), par[:n].tolist(), logp[:n]


def test_selector_tree_is_the_most_probable_prefixes(target_pair, tmp_path):
    """DDTree over a DFlash2 drafter's selector lattice: the engine's best-first builder picks exactly the
    `budget` most probable prefixes of an independent float64 enumeration (with the node log-probs), on the
    lattice the drafter computed; with the chain seed the selector's greedy path comes first."""
    from dflash27b import _handles
    _, target = target_pair
    v1 = make_tiny_draft(tmp_path / "v1", n_layers=2, block_size=8, dtype="f32", seed=7)
    d = to_dflash2(v1, tmp_path / "d2", scale=0.5, seed=2)
    draft = _handles.Draft(str(d), target)
    B, mask, K = draft.info["block_size"], draft.info["mask_token_id"], draft.info["selector_top_k"]
    width = draft.info["hidden"] * draft.info["n_target_layers"]
    dr = _handles.Drafter(draft, target, ring_capacity=4096, n_threads=2)
    dr.push_features(np.random.default_rng(3).standard_normal((12, width)).astype(np.float32))
    block = [17] + [mask] * (B - 1)
    ids, lp, edge = dr.propose_lattice(block, K)
    for budget in (1, 7, 22, 40):
        want = reference_lattice_tree(ids, lp, edge, budget)
        paths, dep, par, logp = engine_lattice_tree(ids, lp, edge, budget, chain_seed=False)
        assert paths == [p for p, _ in want]
        assert np.allclose(logp, [c for _, c in want], atol=1e-4)
        assert all(par[i] < i + 1 for i in range(len(par)))
    path, _, _ = dr.propose_path(block, K)
    paths, dep, par, _ = engine_lattice_tree(ids, lp, edge, 22, chain_seed=True)
    assert paths[:B - 1] == [tuple(path[:k]) for k in range(1, B)]
    assert sorted(paths) == sorted(set(paths)) and len(paths) == 22
