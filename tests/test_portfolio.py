"""Auto mode over a portfolio of drafters (csrc/spec/generator.cpp, one AutoController per drafter): with the
bundled DFlash2 drafter and prompt lookup attached together, each step drafts with the one expected to give
the most tokens per second, or none.  Whatever it picks, the output is AR's (greedy and seeded, after prefix
cache hits too); on text that repeats its context the portfolio drafts with lookup, on new text it keeps
probing both; bad drafter lists are refused by name."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dflash27b import Decoder, DFlashError
from dflash27b.models import __path__ as _models

DRAFT2 = os.path.join(_models[0], "tiny-draft2")
SAMPLING = [{}, {"temperature": 0.8, "seed": 3}]
# text the tiny target continues by repeating what the prompt already holds (an edit of a file it has read)
REPEAT = "import os\nimport sys\n" * 3 + "import os\nimport"


@pytest.fixture(scope="module")
def portfolio():
    with Decoder(draft=[DRAFT2, "lookup"], threads=2, cache_mem=64 << 20) as d:
        yield d


@pytest.fixture(scope="module")
def plain():
    with Decoder(draft=DRAFT2, threads=2) as d:
        yield d


def test_the_portfolio_is_both_drafters_in_the_order_given(portfolio):
    assert portfolio.drafts == (DRAFT2, "lookup")
    assert portfolio._ctx.drafter_names() == ["dflash", "lookup"]
    assert portfolio.draft == f"{DRAFT2} + lookup"
    with Decoder(draft=["lookup", DRAFT2], threads=1, warm_up=False) as d:   # the first given is preferred
        assert d._ctx.drafter_names() == ["lookup", "dflash"]
        ar = d.generate(REPEAT, 24, mode="ar", ignore_eos=True).tokens
        chain = d.generate(REPEAT, 24, mode="chain", ignore_eos=True)
        assert chain.tokens == ar and max(chain.stats.accept_lengths) == 9   # lookup's block (DFlash2's is 16)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", ["def fibonacci(n):\n", REPEAT, "class Stack:\n    def push(self, x):\n"])
def test_every_mode_equals_ar(portfolio, plain, prompt, sampling):
    ar = plain.generate(prompt, 96, mode="ar", ignore_eos=True, **sampling)
    for mode in ("auto", "ddtree", "chain"):
        r = portfolio.generate(prompt, 96, mode=mode, ignore_eos=True, cache=False, **sampling)
        assert r.tokens == ar.tokens, mode
    # after a prefix-cache hit: the next turn (prompt + reply + more) restores the reply's end
    first = portfolio.generate(prompt, 32, mode="auto", ignore_eos=True, **sampling)
    turn2 = first.prompt_tokens + first.tokens + portfolio.tokenize("\n\ndef g(y):\n")
    again = portfolio.generate(turn2, 64, mode="auto", ignore_eos=True, **sampling)
    assert again.stats.cached_tokens > 0
    assert again.tokens == plain.generate(turn2, 64, mode="ar", ignore_eos=True, cache=False, **sampling).tokens


def test_repeated_text_is_drafted_by_lookup():
    """A fresh portfolio (auto's estimates carry across a Decoder's requests: earlier text shapes them) on text
    that repeats its context drafts with lookup."""
    with Decoder(draft=[DRAFT2, "lookup"], threads=2) as fresh:
        r = fresh.generate(REPEAT, 160, mode="auto", ignore_eos=True, cache=False)
    used = [d for d in r.stats.drafter if d]
    assert used and used.count("lookup") > used.count("dflash"), r.stats.auto_summary
    assert "lookup" in r.stats.auto_summary
    assert len(r.stats.drafter) == r.stats.steps


def test_one_drafter_keeps_its_own_block_and_no_drafter_names(plain):
    r = plain.generate("def f(x):\n", 32, mode="auto", ignore_eos=True)
    assert r.stats.drafter == [] and r.stats.block_size == plain.draft_info["block_size"]


@pytest.mark.parametrize("draft, message", [
    ([DRAFT2, DRAFT2], "names a drafter twice"),
    (["lookup", "lookup"], "names a drafter twice"),
    ("lookup+", "an empty drafter name"),
    ([DRAFT2, "/no/such/drafter"], "/no/such/drafter"),
])
def test_bad_drafter_lists_are_refused_by_name(draft, message):
    with pytest.raises(DFlashError, match=message):
        Decoder(draft=draft, threads=1)


def test_cli_takes_drafters_joined_by_plus(plain):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", REPEAT, "-md", f"{DRAFT2}+lookup", "-n", "48",
                        "--ignore-eos", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout)
    assert out["tokens"] == plain.generate(REPEAT, 48, mode="ar", ignore_eos=True).tokens
    assert out["stats"]["mode"] == "auto" and len(out["stats"]["drafter"]) == out["stats"]["steps"]


def test_each_drafters_estimates_are_its_own(portfolio):
    """dfl_context_auto_estimates: the warm-up priced both drafters (one AR cost for both, each its own draft
    cost: DFlash's a forward, lookup's a scan), and a drafter the portfolio does not hold is refused by number."""
    portfolio.generate(REPEAT, 24, mode="auto", ignore_eos=True, cache=False)
    dfl, look = (portfolio._ctx.auto_estimates(k) for k in (0, 1))
    assert dfl["ar_s"] == look["ar_s"] > 0
    assert dfl["draft_s"] > 20 * look["draft_s"] > 0
    assert look["verify_s"] and look["depth_calib"]    # lookup drafted the repeating text and learnt from it
    with pytest.raises(DFlashError, match="drafter 2: the portfolio holds 2"):
        portfolio._ctx.auto_estimates(2)


def test_declined_trees_teach_their_drafter():
    """A tree auto mode drafts and then declines (AR wins the step) still teaches its drafter which of its
    nodes the text followed, once the tokens they guessed are decided (AutoController::observe_declined), so an
    estimate does not go stale while its drafter stops being verified.  Lookup looks at every step it has a
    match and declines some of them on an edited file; each declined tree is learnt from at most once, and
    those decided before the request ends are (the step that decides a tree's last token counts it).  Which
    steps decline depends on the costs measured as the request runs (on a busy machine lookup's cheap trees
    win more often), so requests with the edit at other places run until one has a decided decline."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "python", "dflash27b", "results.py")).read()[:1800]
    declined = learnt = 0
    with Decoder(draft=["lookup"], threads=2) as d:
        for cut in (600, 900, 300, 1200, 450, 750):
            prompt = f"# results.py\n{src}\n\n# results.py, with the edit applied:\n{src[:cut]}"
            d.generate(prompt, 96, mode="auto", ignore_eos=True, cache=False)
            steps = d._ctx.step_stats()
            # looked, then AR (or found no match: no tree, nothing to learn)
            declined += sum(s["drafter"] == 0 and s["auto_budget"] == 0 for s in steps)
            learnt += sum(s["declined_learnt"] for s in steps)
            assert learnt <= declined
            assert all(s["declined_learnt"] == 0 for s in steps if s["auto_budget"] < 0)
            if learnt:
                break
    assert declined, "lookup never looked and declined: the test's text no longer exercises the path"
    assert learnt > 0
