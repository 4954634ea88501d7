"""Classic draft-model speculation: a qwen35 GGUF of the target's vocabulary drafts for it (llama.cpp's -md).

The tests' tiny target in F32 with its Q4_K_M copy (the same float weights, quantised) as the draft model:
chain, DDTree and auto equal AR, greedy and seeded; the draft model keeps its own context and rolls back to
the accepted path from per-position snapshots, so its acceptance stays high over a long decode; a draft model
of another vocabulary is refused with one line naming both files.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash27b import Decoder, DFlashError
from dflash27b.tools.synth import write_synthetic


@pytest.fixture(scope="module")
def dec(synth_gguf):
    with Decoder(synth_gguf("f32"), synth_gguf("q4_k_m"), device="cpu", threads=2, ctx=1024) as d:
        yield d


def test_draft_model_speculation_equals_ar(dec):
    assert dec.default_mode == "auto"
    ids = dec.tokenize("def fibonacci(n):\n")
    ar = dec.generate(ids, 96, ignore_eos=True, mode="ar").tokens
    accept = {}
    for mode in ("chain", "ddtree", "auto"):
        r = dec.generate(ids, 96, ignore_eos=True, mode=mode)
        assert r.tokens == ar, mode
        accept[mode] = r.stats.mean_accept
    assert accept["chain"] >= 3 and accept["ddtree"] >= 3, accept  # 8 draft tokens a step
    kw = dict(ignore_eos=True, temperature=0.8, seed=2)
    assert dec.generate(ids, 48, mode="ddtree", **kw).tokens == dec.generate(ids, 48, mode="ar", **kw).tokens
    # --block-size / block_size sets the draft length; penalties and a second request (rollback from a
    # different history) stay exact too
    r4 = dec.generate(ids, 48, ignore_eos=True, mode="chain", block_size=5)
    assert r4.tokens == ar[:48] and max(r4.stats.accept_lengths) <= 5
    other = dec.tokenize("class Stack:\n")
    assert dec.generate(other, 32, ignore_eos=True, mode="ddtree", frequency_penalty=0.5).tokens == \
        dec.generate(other, 32, ignore_eos=True, mode="ar", frequency_penalty=0.5).tokens


@pytest.mark.parametrize("req", [dict(mode="ddtree", budget=8), dict(mode="chain"),
                                 dict(mode="ddtree", budget=6, temperature=0.9, seed=5)])
def test_draft_model_slots_draft_in_one_forward(dec, req):
    """Slots share their draft model's backend (dfl_context_new_slot's base), so every slot's catch-up and then
    each depth of every slot's greedy chain run as one draft-model forward (DraftModelProposer::prefetch_many,
    Context::forward_many), each slot's ranks the bits it gets alone: every reply == its solo decode, and the
    steps where all three drafted say so; a second round (rollback from snapshots) stays exact."""
    ps = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n"]
    for _ in range(2):
        solo = [dec.generate(p, 24, ignore_eos=True, cache=False, **req).tokens for p in ps]
        many = dec.generate_many(ps, 24, ignore_eos=True, cache=False, parallel=3, **req)
        assert [r.tokens for r in many] == solo
        batches = [s["draft_batch"] for k in range(3) for s in dec._slot(k)._ctx.step_stats()]
        assert batches.count(3) >= 3 and set(batches) <= {0, 2, 3}


def test_expanding_slots_draft_alone(dec):
    """Slots that expand branches (expand=2) draft in propose_tree, each alone: prefetch_many leaves them (a chain
    drafted for them would only be rolled back); every reply == its solo decode."""
    ps = ["def fibonacci(n):\n", "import os\nimport sys\n"]
    req = dict(mode="ddtree", expand=2, budget=8, ignore_eos=True, cache=False)
    solo = [dec.generate(p, 24, **req) for p in ps]
    many = dec.generate_many(ps, 24, parallel=2, **req)
    assert [r.tokens for r in many] == [r.tokens for r in solo]
    assert [r.stats.mean_accept for r in many] == [r.stats.mean_accept for r in solo]


def test_another_vocabulary_is_refused(synth_gguf, tmp_path):
    small = write_synthetic(tmp_path / "vocab1024.gguf", {"base": "tiny", "vocab": 1024}, "q4_k_m", seed=0)
    with pytest.raises(DFlashError, match=r"draft model .*vocab1024\.gguf and target .*tiny-f32\.gguf have "
                                          r"different vocabularies \(sizes 1024 and 2048\)"):
        Decoder(synth_gguf("f32"), small, device="cpu", threads=1)


def test_cli_takes_a_draft_model(synth_gguf):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "-m", str(synth_gguf("f32")), "-md",
                        str(synth_gguf("q4_k_m")), "def f(x):", "-n", "24", "--ignore-eos", "--json", "-t", "2",
                        "--mode", "ddtree", "--compare"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ar"]["same_tokens"] and out["stats"]["mean_accept"] > 1


def test_expanding_branches_equal_ar_and_commit_by_gather(dec, pair):
    """expand=w: each depth runs the w most probable nodes of the one before as one draft tree batch; the
    accepted path is committed in the draft context by gather.  Output == AR (greedy, seeded, auto), the
    acceptance holds over a long decode (the draft context stays in step with the target)."""
    ids = dec.tokenize("def fibonacci(n):\n")
    ar = dec.generate(ids, 96, ignore_eos=True, mode="ar").tokens
    one_pass = dec.generate(ids, 96, ignore_eos=True, mode="ddtree").stats.mean_accept
    for w in (1, 3):
        r = dec.generate(ids, 96, ignore_eos=True, mode="ddtree", expand=w)
        assert r.tokens == ar, w
        assert r.stats.mean_accept >= 3 and r.stats.mean_accept >= one_pass - 0.25, (w, r.stats.mean_accept, one_pass)
        assert max(r.stats.tree_depth) == 8  # the greedy path seeds the tree, 8 drafts deep
    assert dec.generate(ids, 64, ignore_eos=True, mode="auto", expand=2).tokens == ar[:64]
    kw = dict(ignore_eos=True, temperature=0.8, seed=5)
    assert dec.generate(ids, 48, mode="ddtree", expand=2, budget=12, **kw).tokens == \
        dec.generate(ids, 48, mode="ar", **kw).tokens
    # a small budget, no chain seed: still exact
    assert dec.generate(ids, 48, ignore_eos=True, mode="ddtree", expand=2, budget=3, chain_seed=False).tokens == ar[:48]
    with pytest.raises(DFlashError, match="expand"):
        dec.generate(ids, 8, mode="ddtree", expand=-1)
    # a DFlash drafter drafts every depth in one pass: expanding branches is refused, naming what it needs
    with Decoder(*pair, device="cpu", threads=2) as d2, \
            pytest.raises(DFlashError, match=r"expanding branches .* needs a draft model"):
        d2.generate("def f(x):", 8, mode="ddtree", expand=2)
