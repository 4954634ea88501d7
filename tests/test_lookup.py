"""Prompt lookup as a drafter (csrc/spec/lookup_proposer.h; Decoder(draft="lookup"), -md lookup): it drafts what
followed the context's last n-gram earlier in the context, as a chain or a tree of the continuations, with no
weights.  The output is AR's in every mode, greedy and seeded, also after a prefix-cache hit; and it pays where
the text repeats the context (an agent rewriting a function it was shown)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash27b import Decoder, DFlashError

REPO = Path(__file__).resolve().parents[1]
MODES = [("chain", {}), ("ddtree", {"budget": 16}), ("auto", {})]


@pytest.fixture(scope="module")
def dec():
    with Decoder(draft="lookup", threads=2, cache_mem=32 << 20) as d:
        yield d


@pytest.fixture(scope="module")
def rewrites(dec):
    """Held-out function headers, the target's own continuation, then the header again: the reply repeats."""
    heads = [json.loads(x)["prompt"] for x in (REPO / "models/heldout_prompts.jsonl").read_text().splitlines()
             if x.strip()][:4]
    return [h + dec.generate(h, 96, mode="ar", ignore_eos=True, cache=False).text + "\n\n\n" + h for h in heads]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_every_mode_equals_ar(dec, rewrites, sampling):
    for prompt in rewrites[:2]:
        ar = dec.generate(prompt, 48, mode="ar", ignore_eos=True, cache=False, **sampling).tokens
        for mode, kw in MODES:
            assert dec.generate(prompt, 48, mode=mode, ignore_eos=True, cache=False, **kw, **sampling).tokens == ar


def test_it_pays_where_the_context_repeats(dec, rewrites):
    for mode, kw in MODES[:2]:
        acc = []
        for prompt in rewrites:
            acc += dec.generate(prompt, 64, mode=mode, ignore_eos=True, cache=False, **kw).stats.accept_lengths
        assert sum(acc) / len(acc) > 2.5, (mode, sum(acc) / len(acc))


def test_a_step_without_a_match_is_no_probe():
    """Until the reply repeats something, lookup has nothing to draft: those steps are AR steps, not probes (the
    stats had counted 23 probes in the first 23 steps of a 128-token reply), and its first probe stays due."""
    with Decoder(draft="lookup", threads=2, cache_mem=0) as d:
        s = d.generate("def fibonacci(n):", 128, mode="auto", ignore_eos=True, cache=False).stats
    first_tree = next(k for k, b in enumerate(s.auto_budget) if b > 0)
    assert first_tree > 4, s.auto_budget   # (the bundled target repeats itself after a while)
    assert not any(s.probe[:first_tree]), s.probe
    assert sum(s.probe) <= 1 + len(s.probe) // 8, s.probe


def test_after_a_prefix_cache_hit(dec, rewrites):
    p1 = rewrites[0]
    r1 = dec.generate(p1, 24, mode="ddtree", ignore_eos=True)
    p2 = dec.tokenize(p1) + r1.tokens + dec.tokenize("\n\n")
    r2 = dec.generate(p2, 32, mode="ddtree", ignore_eos=True)
    assert r2.stats.cached_tokens > 0
    assert r2.tokens == dec.generate(p2, 32, mode="ar", ignore_eos=True, cache=False).tokens


def test_cli_and_bad_parameters(dec):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "def f(x):", "-md", "lookup", "-n", "16",
                        "--mode", "ddtree", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == dec.generate("def f(x):", 16, mode="ar", ignore_eos=True,
                                                          cache=False).tokens
    for args, why in (((3, 2, 8), "n-gram lengths 3..2"), ((0, 2, 8), "n-gram lengths 0..2"),
                      ((2, 4, 1), "block 1")):
        with pytest.raises(DFlashError, match=why):
            dec._ctx.attach_lookup(*args)
    dec._ctx.attach_lookup(block=9)  # the decoder's own setting back
