"""Sampling: the sampler against an independent numpy reference (chi-squared), counter-based randomness
making chain and DDTree output identical to AR's sampled output, and parameter errors in every front."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder
from dflash27b._lib import DFlashError, load
from tiny_draft import make_tiny_draft

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
LOGITS = np.array([2.0, 1.7, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0], np.float32)


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, pos=0) -> int:
    ffi, lib = load()
    lg = np.ascontiguousarray(logits, np.float32)
    return lib.dfl_sample(ffi.cast("float*", lg.ctypes.data), len(lg), temperature, top_k, top_p, min_p, seed, pos)


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """llama.cpp's chain written independently: top-k, top-p, min-p (softmax at T=1), temperature."""
    x = logits.astype(np.float64)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p)
        n = int(np.argmax(cum >= top_p)) + 1 if (cum >= top_p).any() else len(order)
        order, p = order[:n], p[:n] / p[:n].sum()
    if min_p > 0.0:
        keep = [k for k in range(len(order)) if p[k] >= min_p * p[0]]
        order = [order[k] for k in keep]
    w = np.exp((x[order] - x[order].max()) / temperature)
    out = np.zeros(len(x))
    out[order] = w / w.sum()
    return out


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    torch = pytest.importorskip("torch")
    m = probs > 0
    n = counts.sum()
    stat = float((((counts[m] - n * probs[m]) ** 2) / (n * probs[m])).sum())
    df = int(m.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


SETTINGS = [dict(), dict(temperature=0.5), dict(temperature=1.7), dict(top_k=3), dict(top_k=6, temperature=1.3),
            dict(top_p=0.6), dict(top_p=0.9, temperature=0.8), dict(min_p=0.2), dict(min_p=0.5, temperature=2.0),
            dict(top_k=8, top_p=0.85, min_p=0.1, temperature=0.9)]


@pytest.mark.parametrize("setting", SETTINGS, ids=[json.dumps(s) for s in SETTINGS])
def test_sampler_matches_reference_distribution(setting):
    kw = {"temperature": 1.0, **setting}
    want = reference_probs(LOGITS, **kw)
    n = 20000
    counts = np.zeros(len(LOGITS))
    for i in range(n):  # half over positions, half over seeds: both are the randomness
        t = sample(LOGITS, seed=7, pos=i, **kw) if i % 2 else sample(LOGITS, seed=1000 + i, pos=3, **kw)
        counts[t] += 1
    assert counts[want == 0].sum() == 0, "a filtered-out token was drawn"
    assert chi2_pvalue(counts, want) > 1e-3, (counts / n, want)


def test_sampler_edge_cases():
    am = int(np.argmax(LOGITS))
    assert all(sample(LOGITS, top_k=1, seed=s) == am for s in range(200))           # top-k 1 = greedy
    assert all(sample(LOGITS, temperature=0.0, seed=s) == am for s in range(50))     # T 0 = greedy
    for s in range(50):  # top-p 1.0 and min-p 0 filter nothing: same draw as no filter
        assert sample(LOGITS, seed=s, top_p=1.0, min_p=0.0) == sample(LOGITS, seed=s)
    assert np.allclose(reference_probs(LOGITS, top_p=1.0), reference_probs(LOGITS))
    # the number for a position is a pure function of (seed, pos): call order does not matter
    a = [sample(LOGITS, seed=5, pos=p) for p in range(40)]
    b = [sample(LOGITS, seed=5, pos=p) for p in reversed(range(40))][::-1]
    assert a == b and len(set(a)) > 3


# ---------------------------------------------------------------- exactness in every mode


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("sdraft"), n_layers=1, block_size=8, seed=4)


PROMPT = np.random.default_rng(0).integers(0, 2047, 16).tolist()


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
@pytest.mark.parametrize("drafter", ["distilled", pytest.param("random", marks=pytest.mark.slow)])
def test_sampled_speculative_equals_ar(tiny_f32_gguf, random_draft, drafter, temperature):
    path = DISTILLED if drafter == "distilled" else random_draft
    seeds = [11 + int(temperature * 10), 77] if drafter == "distilled" else [13]
    with Decoder(tiny_f32_gguf, path, kv_type="f32", ctx=1024, threads=2) as d:
        for k, seed in enumerate(seeds):
            kw = dict(ignore_eos=True, temperature=temperature, seed=seed)
            ar = d.generate(PROMPT, 256, mode="ar", **kw)
            for mode in ("chain", "ddtree"):
                r = d.generate(PROMPT, 256, mode=mode, budget=(22, 8)[k % 2], **kw)
                assert r.tokens == ar.tokens, (mode, seed)
                assert r.stats.temperature == temperature and r.stats.seed == seed
            assert d.generate(PROMPT, 256, mode="ar", **{**kw, "seed": seed + 100}).tokens != ar.tokens


def test_sampled_with_filters_equals_ar(tiny_f32_gguf):
    kw = dict(ignore_eos=True, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=5)
    with Decoder(tiny_f32_gguf, DISTILLED, kv_type="q4_0", ctx=1024, threads=2) as d:
        ar = d.generate(PROMPT, 256, mode="ar", **kw).tokens
        assert d.generate(PROMPT, 256, mode="ddtree", budget=16, **kw).tokens == ar
        assert d.generate(PROMPT, 256, mode="chain", block_size=8, **kw).tokens == ar


# ---------------------------------------------------------------- errors


BAD = [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
       (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
       (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p")]


@pytest.mark.parametrize("bad,name", BAD)
def test_invalid_sampling_parameters(tiny_f32_gguf, bad, name):
    with Decoder(tiny_f32_gguf, threads=1) as d:
        with pytest.raises(DFlashError, match=name):
            d.generate([1, 2, 3], 4, **bad)
        # the core refuses them as well (other bindings reach it directly)
        args = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **bad}
        with pytest.raises(DFlashError, match=name):
            d.context.generate_begin([1, 2, 3], 4, False, [], **args)
    assert sample(LOGITS, **{"temperature": 1.0, **bad}) == -1


@pytest.mark.parametrize("flag,value,name", [("--temp", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                             ("--top-k", "-2", "top_k"), ("--min-p", "3", "min_p")])
def test_cli_invalid_sampling(tiny_f32_gguf, flag, value, name):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "-m", str(tiny_f32_gguf), "--prompt-ids",
                        "1,2", "-n", "2", flag, value], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and name in r.stderr


def test_cli_seeded_sampling_json(tiny_f32_gguf):
    base = [sys.executable, "-m", "dflash27b.cli", "generate", "-m", str(tiny_f32_gguf), "--prompt-ids", "1,2,3",
            "-n", "16", "--ignore-eos", "--json", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p",
            "0.05"]
    a = json.loads(subprocess.run(base + ["--seed", "42"], capture_output=True, text=True).stdout)
    b = json.loads(subprocess.run(base + ["-s", "42"], capture_output=True, text=True).stdout)
    assert a["tokens"] == b["tokens"] and a["stats"]["seed"] == 42 and a["stats"]["temperature"] == 0.8
