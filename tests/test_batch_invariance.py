"""Batch invariance: a token's logits never depend on what else is in the batch.

For every weight type and every KV type, logits computed token by token, as one
batch, in random splits, and as a non-committing chain verify (parents i-1)
are compared with `==`.
"""
import numpy as np
import pytest

from dflash27b import Decoder

FTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]
KV_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0"]


def _logits_in_pieces(ctx, ids, cuts):
    ctx.reset()
    out = []
    for a, b in zip([0] + cuts, cuts + [len(ids)]):
        lg, _ = ctx.forward(ids[a:b])
        out.append(lg)
    return np.concatenate(out)


@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("kv", KV_TYPES)
def test_token_by_token_equals_batch_equals_splits(synth_gguf, ftype, kv):
    rng = np.random.default_rng(hash((ftype, kv)) % 2**32)
    ids = rng.integers(0, 2000, size=24).tolist()
    with Decoder(synth_gguf(ftype), kv_type=kv, ctx=64, threads=2) as d:
        ctx = d.context
        whole = _logits_in_pieces(ctx, ids, [])
        single = _logits_in_pieces(ctx, ids, list(range(1, len(ids))))
        assert np.array_equal(whole, single)
        for _ in range(2):
            cuts = sorted(rng.choice(np.arange(1, len(ids)), size=3, replace=False).tolist())
            assert np.array_equal(whole, _logits_in_pieces(ctx, ids, cuts))
        # a verify batch (not committed) continuing a committed prefix sees the same numbers
        ctx.reset()
        ctx.forward(ids[:10])
        lg, _ = ctx.forward(ids[10:], parent=list(range(-1, len(ids) - 11)), commit=False)
        assert np.array_equal(whole[10:], lg)
        assert ctx.n_past == 10


def test_internal_chunking_is_invisible(synth_gguf):
    """A prefill longer than the batch size is cut internally; results are unchanged."""
    ids = np.random.default_rng(7).integers(0, 2000, size=40).tolist()
    with Decoder(synth_gguf("q4_k_m"), ctx=64, threads=2) as a, Decoder(synth_gguf("q4_k_m"), ctx=64, threads=2,
                                                                        batch=7) as b:
        assert np.array_equal(a.logits(ids), b.logits(ids))


def test_thread_count_does_not_change_results(synth_gguf):
    ids = np.random.default_rng(8).integers(0, 2000, size=12).tolist()
    with Decoder(synth_gguf("q4_k_m"), ctx=64, threads=1) as a, Decoder(synth_gguf("q4_k_m"), ctx=64,
                                                                        threads=2) as b:
        assert np.array_equal(a.logits(ids), b.logits(ids))


def test_hidden_capture_is_residual_after_layer(synth_gguf):
    """Captured features are the residual stream after the named layers, in the order asked."""
    ids = [5, 9, 200, 31]
    with Decoder(synth_gguf("f32"), kv_type="f32", ctx=16, threads=2) as d:
        h = d.hidden_states(ids, [1, 6, 3])
        assert h.shape == (4, 3, d.info["n_embd"])
        h2 = d.hidden_states(ids, [3])
        assert np.array_equal(h[:, 2], h2[:, 0])
        assert np.isfinite(h).all() and not np.array_equal(h[:, 0], h[:, 1])


@pytest.mark.parametrize("threads", [2, 3])
def test_threadpool_visits_every_index_once(threads):
    """Consecutive parallel loops on one pool: a late worker must never run a part of a finished loop
    with the next loop's bounds (a race seen once as a duplicated range)."""
    from dflash27b._lib import check, load
    _, lib = load()
    check(lib.dfl_selftest_threadpool(threads, 300000))


@pytest.mark.parametrize("ftype", ["q4_k_m", "q5_k_m", "q6_k", "f32", "f16", "bf16"])
def test_cpu_kernel_sets_agree_bit_for_bit(synth_gguf, ftype):
    """Where the CPU has AVX-512, its kernels (K-quant panels of 16-byte row pieces, the delta rule
    on 64 columns, float dots 4 rows a pass, attention's P.V on 512-bit rows) give the AVX2 kernels'
    logits bit for bit: a prefill, a tree verify and AR steps."""
    from dflash27b._lib import load

    ffi, lib = load()
    if lib.dfl_cpu_avx512(1) != 0:
        pytest.skip(ffi.string(lib.dfl_last_error()).decode())
    ids = np.random.default_rng(9).integers(0, 2000, size=30).tolist()
    runs = []
    try:
        for avx512 in (0, 1):
            assert lib.dfl_cpu_avx512(avx512) == 0
            with Decoder(synth_gguf(ftype), ctx=64, threads=2) as d:
                ctx = d.context
                pre, _ = ctx.forward(ids[:20])
                tree, _ = ctx.forward(ids[20:26], parent=[-1, 0, 0, 1, 2, 4], commit=False)
                steps = [ctx.forward([t])[0] for t in ids[20:24]]
                runs.append([pre, tree, *steps])
    finally:
        lib.dfl_cpu_avx512(-1)
    for a, b in zip(*runs):
        assert np.array_equal(a, b)
