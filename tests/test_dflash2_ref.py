"""Self-test of the DFlash2 PyTorch oracle (tests/dflash2_ref.py) on the tiny DFlash2 checkpoint of
tests/test_dflash2_load.py: invariants that need no other implementation — shapes, the incremental context,
the convolution's causality / grouping / identity form (identity convs give the v1 forward of the same weights),
the unary transform (multiplier, then softcap), the masks (sliding window, causal / non-causal), the greedy walk
(root first, argmax of unary + transition among the top-K, tie-breaking) and determinism."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from dflash2_ref import DFlash2Ref, attention_mask, grouped_dynamic_conv, load_dflash2, parse_config  # noqa: E402
from test_dflash2_load import BUNDLED, _write_dflash2  # noqa: E402

H, V, NF, C, B, K = 256, 4096, 4 * 256, 12, 8, 16     # hidden, vocab, feature width (4 target layers), ctx, block
ROOT = 17


def _inputs(seed=1, head_scale=0.25):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(C, NF, generator=g, dtype=torch.float64)
    embed = torch.randn(V, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64) * head_scale
    return feats, embed, head


def _scale_selector(t, by=30.0):
    for k in ("hidden_projection.weight", "predecessor_codebook", "successor_codebook"):
        t["candidate_selector." + k] = (t["candidate_selector." + k].float() * by).to(torch.bfloat16)


def _identity_convs(t):
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, 2, H)
            base[:, 0, :] = 1.0
            t[f"layers.{i}.{conv}.base_kernel"] = base.to(torch.bfloat16)
            t[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.zeros(2 * 2 * (H // 16), H, dtype=torch.bfloat16)


def _strong_convs(t):
    """Non-trivial convs: base near the identity tap plus noise, δ large enough to matter."""
    g = torch.Generator().manual_seed(7)
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, 2, H)
            base[:, 0, :] = 1.0
            base += 0.3 * torch.randn(2, 2, H, generator=g)
            t[f"layers.{i}.{conv}.base_kernel"] = base.to(torch.bfloat16)
            kp = f"layers.{i}.{conv}.kernel_projection.weight"
            t[kp] = (t[kp].float() * 20).to(torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny matrices run faster on one thread than on several (and the results do not depend on it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def d2(tmp_path_factory):
    """The tiny DFlash2 drafter with convs and selector strong enough to change the outputs."""
    return _write_dflash2(tmp_path_factory.mktemp("d2") / "d2",
                          tensors_edit=lambda t: (_strong_convs(t), _scale_selector(t)))


@pytest.fixture(scope="module")
def ref(d2):
    return load_dflash2(d2)


def _block(ref):
    return [ROOT] + [ref.cfg.mask_token_id] * (ref.cfg.block_size - 1)


def test_config_of_the_tiny_checkpoint(ref):
    c = ref.cfg
    assert (c.generation, c.block_size, c.conv_kernel_size, c.conv_group_size, c.selector_top_k, c.selector_rank) \
        == (2, B, 2, 16, K, 32)
    assert (c.hidden, c.vocab, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (H, V, 2, 4, 2, 64)
    assert c.causal == [False, False] and c.softcap is None and c.output_multiplier == 1.0
    # §5 causality without is_causal: sliding layers causal, full layers not; with it, it decides every layer
    raw = dict(c.raw, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    assert parse_config({k: v for k, v in raw.items() if k != "is_causal"}).causal == [True, False]
    assert parse_config(dict(raw, is_causal=True)).causal == [True, True]


def test_shapes_and_incremental_context(ref):
    feats, embed, head = _inputs()
    ctx = ref.context_kv(feats)
    assert ctx.c.shape == (C, H) and len(ctx) == C and ctx.positions.tolist() == list(range(C))
    assert all(k.shape == v.shape == (C, 2, 64) for k, v in zip(ctx.k, ctx.v))
    # the context in two pushes (7 rows, then 5 at positions 7..11) is the context in one
    two = ref.context_kv(feats[:7]).extend(ref.context_kv(feats[7:], start=7))
    assert torch.equal(two.positions, ctx.positions)
    for a, b in zip(two.k + two.v + [two.c], ctx.k + ctx.v + [ctx.c]):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    out = ref.block_forward(ctx, _block(ref), C, embed, head)
    assert out.logits.shape == out.raw_logits.shape == (B - 1, V)
    assert out.hidden.shape == (B - 1, H) and out.hidden_all.shape == (B, H)
    assert torch.equal(out.hidden, out.hidden_all[1:]) and len(out.residual) == 3
    assert torch.allclose(out.raw_logits, out.hidden @ head.T)
    path = ref.greedy_path(ROOT, out.logits, out.hidden, out.raw_logits)
    assert len(path.tokens) == len(path.predecessors) == len(path.choice) == B - 1
    assert path.cand_ids.shape == path.unary.shape == path.scores.shape == (B - 1, K)
    # positions as a list, and an explicit context passed as features at other positions, are accepted
    same = ref.block_forward(ctx, _block(ref), list(range(C, C + B)), embed, head)
    assert torch.equal(same.logits, out.logits)


def _conv_weights(ref, layer=0, which="attention_conv"):
    p = f"layers.{layer}.{which}."
    return ref.w[p + "base_kernel"], ref.w[p + "kernel_projection.weight"]


def test_conv_is_causal(ref):
    """Changing block row j changes no conv output row < j (prepare and finish applied alone), and — with two
    taps — none after j + 1; the finish side's δ of row j only touches row j."""
    T = ref.cfg.conv_kernel_size
    g = torch.Generator().manual_seed(3)
    n = torch.randn(B, H, generator=g, dtype=torch.float64)
    y = torch.randn(B, H, generator=g, dtype=torch.float64)
    for which in ("attention_conv", "mlp_conv"):
        for layer in range(2):
            prep0, fin0 = ref.conv_pair(layer, which, n)
            out0 = fin0(y)
            for j in range(B):
                n2 = n.clone()
                n2[j] += torch.randn(H, generator=g, dtype=torch.float64)
                prep, fin = ref.conv_pair(layer, which, n2)
                assert torch.equal(prep[:j], prep0[:j]) and torch.equal(prep[j + T:], prep0[j + T:])
                assert not torch.allclose(prep[j], prep0[j])
                out = fin(y)   # δ from the changed input row j: only output row j moves
                assert torch.equal(out[:j], out0[:j]) and torch.equal(out[j + 1:], out0[j + 1:])
                assert not torch.allclose(out[j], out0[j])
                y2 = y.clone()
                y2[j] += torch.randn(H, generator=g, dtype=torch.float64)
                out = fin0(y2)
                assert torch.equal(out[:j], out0[:j]) and torch.equal(out[j + T:], out0[j + T:])
                if j + 1 < B:
                    assert not torch.allclose(out[j + 1], out0[j + 1])   # the tap reading the previous row


def test_conv_taps_and_groups():
    """Row 0 has no predecessor (zero left padding); group g covers channels 16g..16g+15; row i's δ weights
    both taps of row i."""
    g = torch.Generator().manual_seed(4)
    u = torch.randn(B, H, generator=g, dtype=torch.float64)
    base = torch.randn(2, H, generator=g, dtype=torch.float64)
    zero = torch.zeros(B, 2, H // 16, dtype=torch.float64)
    out = grouped_dynamic_conv(u, base, zero, 16)
    assert torch.allclose(out[0], base[0] * u[0], rtol=0, atol=0)
    assert torch.allclose(out[1:], base[0] * u[1:] + base[1] * u[:-1], rtol=0, atol=1e-15)
    delta = zero.clone()
    delta[5, 1, 3] = 0.5                     # row 5, tap 1 (previous row), group 3
    diff = grouped_dynamic_conv(u, base, delta, 16) - out
    want = torch.zeros(B, H, dtype=torch.float64)
    want[5, 48:64] = 0.5 * u[4, 48:64]
    assert torch.allclose(diff, want, rtol=0, atol=1e-15)


def test_identity_conv_is_the_v1_forward(tmp_path):
    """base_kernel = identity tap, kernel_projection = 0: every conv is the identity, and the block forward is
    the DFlash v1 forward of the same weights (the bundled tiny v1 drafter the checkpoint is made from)."""
    ref = load_dflash2(_write_dflash2(tmp_path / "id", tensors_edit=_identity_convs))
    n = torch.randn(B, H, dtype=torch.float64)
    y = torch.randn(B, H, dtype=torch.float64)
    for layer in range(2):
        for which in ("attention_conv", "mlp_conv"):
            prep, fin = ref.conv_pair(layer, which, n)
            assert torch.equal(prep, n) and torch.equal(fin(y), y)
    v1 = load_dflash2(BUNDLED / "tiny-draft")
    assert v1.cfg.generation == 1
    feats, embed, head = _inputs()
    block = _block(ref)
    a = ref.block_forward(ref.context_kv(feats), block, C, embed, head)
    b = v1.block_forward(v1.context_kv(feats), block, C, embed, head)
    assert torch.equal(a.hidden_all, b.hidden_all) and torch.equal(a.logits, b.logits)
    # and the real (strong) convs do change it
    strong = load_dflash2(_write_dflash2(tmp_path / "strong", tensors_edit=_strong_convs))
    c = strong.block_forward(strong.context_kv(feats), block, C, embed, head)
    assert not torch.allclose(c.logits, a.logits, atol=1e-3)


@pytest.mark.parametrize("mult,cap", [(2.5, 3.0), (1.0, 0.75), (0.5, None)])
def test_multiplier_then_softcap(tmp_path, mult, cap):
    def edit(c):
        c["dflash_config"]["output_multiplier"] = mult
        if cap is not None:
            c["dflash_config"]["final_logit_softcapping"] = cap
    ref = load_dflash2(_write_dflash2(tmp_path / "sc", cfg_edit=edit, tensors_edit=_strong_convs))
    feats, embed, head = _inputs(head_scale=0.1)   # raw logits up to a few caps: bound, but no tanh(x) == 1.0
    out = ref.block_forward(ref.context_kv(feats), _block(ref), C, embed, head)
    z = out.raw_logits * mult
    if cap is None:
        assert torch.allclose(out.logits, z, rtol=0, atol=1e-12)
        return
    assert (out.raw_logits.abs() * mult > cap).any()             # the cap binds somewhere
    assert (out.logits.abs() <= cap).all()
    assert torch.allclose(out.logits, cap * torch.tanh(z / cap), rtol=0, atol=1e-12)
    if mult != 1.0:   # multiply first, then cap (§3.5): the other order gives other values
        assert not torch.allclose(out.logits, mult * cap * torch.tanh(out.raw_logits / cap))
    assert torch.equal(out.logits.argmax(-1), out.raw_logits.argmax(-1))   # monotone
    assert torch.equal(ref.candidates(out.logits)[0], ref.candidates(out.logits, raw_logits=out.raw_logits)[0])


def test_greedy_path_is_argmax_of_unary_plus_transition(ref):
    feats, embed, head = _inputs()
    out, path = ref.propose(ref.context_kv(feats), ROOT, C, embed, head)
    A = ref.w["candidate_selector.predecessor_codebook"]
    Bc = ref.w["candidate_selector.successor_codebook"]
    P = ref.w["candidate_selector.hidden_projection.weight"]
    assert path.predecessors[0] == ROOT
    assert path.predecessors[1:] == path.tokens[:-1]
    for t in range(B - 1):
        # candidates: the top-K of the row's logits, sorted by value, with their transformed logits as unary
        top = torch.topk(out.logits[t], K)
        assert set(path.cand_ids[t].tolist()) == set(top.indices.tolist())
        assert torch.equal(path.unary[t], out.logits[t][path.cand_ids[t]])
        assert (path.unary[t][:-1] >= path.unary[t][1:]).all()
        # the score of every candidate, element by element: u + Σ_r A[prev, r] · (P h)[r] · Bc[cand, r]
        gate = [float((P[r] * out.hidden[t]).sum()) for r in range(P.shape[0])]
        prev = path.predecessors[t]
        for j in range(K):
            cj = int(path.cand_ids[t, j])
            s = float(path.unary[t, j]) + sum(float(A[prev, r]) * gate[r] * float(Bc[cj, r]) for r in range(len(gate)))
            assert abs(s - float(path.scores[t, j])) < 1e-9
        j = int(torch.argmax(path.scores[t]))
        assert path.choice[t] == j and path.tokens[t] == int(path.cand_ids[t, j])
    # the transition term matters here: some step does not take the best unary candidate
    assert any(j != 0 for j in path.choice)
    # another root changes the first row's scores; the lattice holds the walked rows
    assert not torch.allclose(ref.selector_scores(out.hidden[0], ROOT + 1, path.cand_ids[0], path.unary[0]),
                              path.scores[0])
    lat = ref.selector_lattice(ROOT, path.cand_ids, out.hidden, path.unary)
    assert lat.shape == (B - 1, K, K)
    assert torch.allclose(lat[0], path.scores[0].expand(K, K))
    for t in range(1, B - 1):
        assert torch.allclose(lat[t, path.choice[t - 1]], path.scores[t])


def test_tie_breaking(ref):
    """Candidates: (value desc, id asc), or the raw logits' order when given; the walk takes the first maximum."""
    w = dict(ref.w)
    w["candidate_selector.predecessor_codebook"] = torch.zeros_like(w["candidate_selector.predecessor_codebook"])
    flat = DFlash2Ref(ref.cfg, w)          # transition term 0: scores = unary
    logits = torch.full((B - 1, V), -5.0, dtype=torch.float64)
    logits[:, [900, 30, 4000, 7]] = 2.0     # four tied best values
    logits[:, 12] = 3.0
    hidden = torch.randn(B - 1, H, dtype=torch.float64)
    cand, unary = flat.candidates(logits)
    assert cand[0, :5].tolist() == [12, 7, 30, 900, 4000] and unary[0, 0] == 3.0
    logits[:, 12] = 2.0                     # five ties: the walk picks the lowest index = the lowest id
    path = flat.greedy_path(ROOT, logits, hidden)
    assert path.tokens == [7] * (B - 1) and path.choice == [0] * (B - 1)
    raw = logits.clone()
    raw[:, 4000] = 2.5                      # tied after the transform, distinct before: the raw order decides
    path = flat.greedy_path(ROOT, logits, hidden, raw_logits=raw)
    assert path.cand_ids[0, :2].tolist() == [4000, 7] and path.tokens == [4000] * (B - 1)


def test_attention_masks():
    """§5 with the published numbers (W = 2048, B = 8): block row i sees 2047 - i context tokens and all 8 block
    rows when non-causal; causal layers see block rows ≤ i."""
    Cn = 3000
    q = torch.arange(Cn, Cn + 8)
    k = torch.arange(Cn + 8)
    m = attention_mask(q, k, causal=False, window=2048)
    assert m[:, :Cn].sum(1).tolist() == [2047 - i for i in range(8)] and m[:, Cn:].all()
    mc = attention_mask(q, k, causal=True, window=2048)
    assert torch.equal(mc[:, Cn:], torch.ones(8, 8, dtype=torch.bool).tril())
    assert attention_mask(q, k, causal=False, window=None).all()


def test_sliding_window_hides_old_context(tmp_path):
    def edit(c):
        c.update(layer_types=["sliding_attention"] * 2, sliding_window=6)
    ref = load_dflash2(_write_dflash2(tmp_path / "swa", cfg_edit=edit, tensors_edit=_strong_convs))
    assert ref.cfg.causal == [False, False]
    feats, embed, head = _inputs()
    base = ref.block_forward(ref.context_kv(feats), _block(ref), C, embed, head)
    old, recent = feats.clone(), feats.clone()
    old[:7] += 1.0          # positions 0..6: row i (position 12 + i) sees positions > 6 + i only
    recent[11] += 1.0
    assert torch.equal(ref.block_forward(ref.context_kv(old), _block(ref), C, embed, head).logits, base.logits)
    assert not torch.allclose(ref.block_forward(ref.context_kv(recent), _block(ref), C, embed, head).logits,
                              base.logits)


@pytest.mark.parametrize("is_causal", [True, False])
def test_block_causality(tmp_path, is_causal):
    """is_causal true: changing block token j changes no hidden row < j (attention masked, convs causal);
    false (the published setting): the last row's token reaches row 0."""
    ref = load_dflash2(_write_dflash2(tmp_path / "c", cfg_edit=lambda c: c.update(is_causal=is_causal),
                                      tensors_edit=_strong_convs))
    feats, embed, head = _inputs()
    ctx = ref.context_kv(feats)
    block = [ROOT] + [5, 9, 300, 41, 2000, 77, 3]
    base = ref.block_forward(ctx, block, C, embed, head).hidden_all
    for j in range(1, B):
        b2 = list(block)
        b2[j] = 1234
        h = ref.block_forward(ctx, b2, C, embed, head).hidden_all
        assert not torch.allclose(h[j], base[j])
        if is_causal:
            assert torch.equal(h[:j], base[:j])
        else:
            assert not torch.allclose(h[0], base[0])


def test_deterministic(d2):
    feats, embed, head = _inputs()
    runs = []
    for _ in range(2):
        r = load_dflash2(d2)
        out, path = r.propose(r.context_kv(feats), ROOT, C, embed, head)
        runs.append((out, path))
    (o1, p1), (o2, p2) = runs
    assert torch.equal(o1.logits, o2.logits) and torch.equal(o1.hidden_all, o2.hidden_all)
    assert p1.tokens == p2.tokens and torch.equal(p1.scores, p2.scores) and torch.equal(p1.cand_ids, p2.cand_ids)


def test_float32_agrees_with_float64(d2):
    feats, embed, head = _inputs()
    o64, p64 = load_dflash2(d2).propose(None, ROOT, 0, embed, head)
    r32 = load_dflash2(d2, dtype=torch.float32)
    o32, p32 = r32.propose(None, ROOT, 0, embed.float(), head.float())
    assert o32.logits.dtype == torch.float32
    assert torch.allclose(o32.logits.double(), o64.logits, atol=1e-4)
    assert p32.tokens == p64.tokens


def test_published_tensor_names(d2):
    """The loader reads the published names (codebooks without `.weight`) and refuses a stray tensor."""
    from safetensors.torch import load_file
    names = set(load_file(str(d2 / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names
    cfg = parse_config(json.loads((Path(d2) / "config.json").read_text()))
    w = load_file(str(d2 / "model.safetensors"))
    w["mask_embedding"] = torch.zeros(H)
    with pytest.raises(ValueError, match="unexpected tensors"):
        DFlash2Ref(cfg, w)
