"""Auto mode: each step AR or the DDTree budget that maximises expected tokens per second.

The chooser alone (`dfl_auto_choose`) with synthetic costs and acceptance; then decoding: auto's output
equals AR's (greedy and seeded sampling) whatever it chooses, with the distilled drafter, a random one, and
the oracle drafter (a top-k hook proposing the target's known continuation), where speculation must win and
auto must choose it.  Speed is measured in bench/auto_cpu.py, not here.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder, DFlashError
from dflash27b._lib import check, load
from dflash27b.decoder import bundled_pair
from dflash27b.tools.oracle_draft import attach_oracle
from tiny_draft import make_tiny_draft

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"
TRAIN_PROMPT = np.random.default_rng(0).integers(0, 2047, 16).tolist()  # the distilled drafter's first


def estimates(ar_s, verify: dict[int, float], *, draft_s=0.0, tree_s=0.0, commit_s=0.0, calib=(), masks=None):
    """The controller's tables as the dev API takes them (dfl_auto_estimates); masks: (an AR step's, a tree's)
    under a constraint."""
    ffi, _ = load()
    e = ffi.new("dfl_auto_estimates*")
    e.ar_s, e.draft_s, e.tree_s, e.commit_s = ar_s, draft_s, tree_s, commit_s
    if masks is not None:
        e.mask_ar_s, e.mask_tree_s = masks
        e.constrained = 1
    e.n_verify = len(verify)
    for i, (n, t) in enumerate(sorted(verify.items())):
        e.verify_nodes[i], e.verify_s[i] = n, t
    e.n_calib = len(calib)
    for i, c in enumerate(calib):
        e.depth_calib[i] = c
    return e


def choice(ar_s, verify: dict[int, float], depth, p, *, draft_s=0.0, tree_s=0.0, commit_s=0.0, calib=(),
           min_budget=0, with_draft=False, max_worst=math.inf, masks=None):
    """The chooser's whole answer (dfl_auto_choice) for a tree of these depths and path probabilities."""
    ffi, lib = load()
    e = estimates(ar_s, verify, draft_s=draft_s, tree_s=tree_s, commit_s=commit_s, calib=calib, masks=masks)
    d = np.asarray(depth, dtype=np.int32)
    lp = np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)
    out = ffi.new("dfl_auto_choice*")
    check(lib.dfl_auto_choose(e, ffi.cast("int32_t*", d.ctypes.data), ffi.cast("float*", lp.ctypes.data), len(d),
                              min_budget, int(with_draft), max_worst, out))
    return out


def choose(*args, **kw):
    out = choice(*args, **kw)
    return out.budget, out.expected_tokens, out.tok_s, out.ar_tok_s


def chosen_depth(*args, **kw):
    out = choice(*args, **kw)
    return out.budget, out.depth


def chain(n, q):
    """A chain of n nodes whose depth-d path probability is q**d."""
    return list(range(1, n + 1)), [q ** d for d in range(1, n + 1)]


# ---------------------------------------------------------------- the chooser, synthetic costs

def test_cheap_verify_and_high_acceptance_choose_a_large_tree():
    depth, p = chain(22, 0.97)
    ar = 0.010
    b, expected, tok_s, ar_tok_s = choose(ar, {23: ar * 1.2}, depth, p, draft_s=0.002, with_draft=True)
    assert b == 22 and expected == pytest.approx(1 + sum(p), rel=1e-5)
    assert tok_s > 5 * ar_tok_s and ar_tok_s == pytest.approx(100.0)


def test_verify_at_half_an_ar_step_per_node_chooses_ar():
    depth, p = chain(22, 0.45)
    ar = 0.010
    verify = {n: ar * (1 + 0.5 * (n - 1)) for n in (1, 2, 5, 23)}
    b, expected, tok_s, ar_tok_s = choose(ar, verify, depth, p, draft_s=0.5 * ar, with_draft=True)
    assert b == 0 and expected == 1.0 and tok_s == ar_tok_s
    # once drafted, the draft is sunk: still AR (1.45 tokens for 1.5 AR steps loses to 1 for 1)
    assert choose(ar, verify, depth, p)[0] == 0
    # a probe forces at least one node, and then the best such budget
    assert choose(ar, verify, depth, p, min_budget=1)[0] == 1


def test_budget_stops_where_acceptance_stops_paying():
    # a tree: a confident chain of 6, then 16 unlikely side branches; verify 5% of AR per node
    depth = list(range(1, 7)) + [1] * 16
    p = [0.95 ** d for d in range(1, 7)] + [0.001] * 16
    ar = 0.01
    verify = {1: ar, 23: ar * (1 + 0.05 * 22)}
    b, *_ = choose(ar, verify, depth, p)
    assert b == 6


def test_the_choice_names_the_depth_its_tree_reaches():
    """What an autoregressive drafter (the MTP head, a draft model: a forward per depth) is asked to draft in
    auto mode: the forecast tree's deepest node, plus one.  A wide shallow tree reaches depth 1 whatever its
    budget; a chain its budget; AR none."""
    ar = 0.010
    verify = {2: 1.02 * ar, 8: 1.1 * ar, 23: 1.5 * ar}
    # five siblings at depth 1 (p 0.9, 0.05, ...), then their children
    depth = [1, 1, 1, 2, 2, 3]
    p = [0.9, 0.05, 0.03, 0.85, 0.04, 0.8]
    b, d = chosen_depth(ar, verify, depth, p)
    assert b > 0 and d == max(depth[:b])
    assert chosen_depth(ar, verify, *chain(6, 0.95)) == (6, 6)
    assert chosen_depth(ar, {2: 3 * ar}, *chain(6, 0.95)) == (0, 0)


def test_calibration_scales_acceptance():
    depth, p = chain(8, 0.9)
    ar = 0.01
    verify = {1: ar, 9: ar * 1.4}
    assert choose(ar, verify, depth, p)[0] == 8
    # the drafter has been wrong at depth 1 every time: its drafts are worth nothing
    assert choose(ar, verify, depth, p, calib=[1.0, 0.0])[0] == 0


def test_verify_table_interpolates_and_extrapolates():
    depth, p = chain(10, 1.0)  # sure drafts: the rate is (1 + b) / verify(b + 1)
    ar = 0.01
    _, e4, r4, _ = choose(ar, {1: ar, 3: 3 * ar}, depth, p, min_budget=4)  # beyond: slope ar per node
    assert r4 == pytest.approx(5 / (3 * ar + 2 * ar))
    _, _, r1, _ = choose(ar, {1: ar, 3: 3 * ar}, depth, p, min_budget=1)  # between: 2 nodes cost 2 ar
    assert r1 == pytest.approx(2 / (2 * ar))


def test_chooser_rejects_bad_tables():
    ffi, lib = load()
    e = ffi.new("dfl_auto_estimates*")
    e.n_verify = 65
    out = ffi.new("dfl_auto_choice*")
    with pytest.raises(DFlashError, match="at most 64 entries"):
        check(lib.dfl_auto_choose(e, ffi.NULL, ffi.NULL, 0, 0, 0, math.inf, out))


def test_a_bet_is_sized_to_what_the_request_can_lose():
    """The loss allowance (adaptive.h LossAllowance) bounds a tree by its worst case, its whole cost for one
    token: a tree the odds favour is cut to the largest budget whose cost is within the allowance of an AR
    step, and with nothing to lose the step is AR, however good the odds."""
    depth, p = chain(22, 0.97)
    ar = 0.010
    verify = {2: 1.05 * ar, 8: 1.35 * ar, 23: 2.1 * ar}     # 0.05 AR steps a node from 2 to 8, then 0.05
    assert choose(ar, verify, depth, p)[0] == 22
    b, expected, _, _ = choose(ar, verify, depth, p, max_worst=0.36 * ar)   # verify(b + 1) <= 1.36 ar
    assert b == 7 and expected == pytest.approx(1 + sum(p[:7]), rel=1e-5)
    assert choose(ar, verify, depth, p, max_worst=0.04 * ar)[0] == 0
    assert choose(ar, verify, depth, p, max_worst=0.04 * ar, min_budget=1)[0] == 0   # a probe too


def allowance(n_new, ar_s, steps):
    """(bet_s, probe_s) of a request's LossAllowance after these drafted steps (dicts of dfl_auto_step's fields)."""
    ffi, lib = load()
    arr = ffi.new("dfl_auto_step[]", max(len(steps), 1))
    for i, st in enumerate(steps):
        for k, v in st.items():
            setattr(arr[i], k, v)
    bet, probe = ffi.new("double*"), ffi.new("double*")
    check(lib.dfl_auto_allowance(n_new, ar_s, arr, len(steps), bet, probe))
    return bet[0], probe[0]


def test_probes_share_one_allowance_across_a_portfolio():
    """A request's probes draw on one share, 1% of its AR time, whichever drafter of a portfolio probes: each
    drafter's own spacing bounds only how often it explores, so two probing drafters (DFlash2 and the MTP head)
    could each spend a share on top of the bets' 2%, towards the 0.95x floor auto promises.  What a probe wins is
    not credited to anything; what it loses is gone from the probes' share alone, never from the bets'."""
    ar = 0.010
    bet0, probe0 = allowance(200, ar, [])
    assert probe0 == pytest.approx(0.01 * 200 * ar) and bet0 == pytest.approx(0.5 * 0.02 * 200 * ar)
    # a probe that drafted 1 ms and verified in 1.5 AR steps' time: 1.6 AR steps for 1 token, 0.6 lost
    lost = {"probe": 1, "budget": 1, "committed": 1, "draft_s": 0.001, "verify_s": 0.015}
    bet, probe = allowance(200, ar, [lost])
    assert bet == pytest.approx(bet0) and probe == pytest.approx((2.0 - 0.6) * ar)
    # a second drafter's probe draws on the same share, and the share does not go below nothing
    assert allowance(200, ar, [lost, dict(lost, draft_s=0.002)])[1] == pytest.approx((2.0 - 0.6 - 0.7) * ar)
    assert allowance(200, ar, [lost] * 4) == (pytest.approx(bet0), 0.0)
    # a probe that won (4 tokens for 2.6 AR steps' time) leaves both shares as they were
    won = dict(lost, committed=4, budget=3)
    assert allowance(200, ar, [won]) == (pytest.approx(bet0), pytest.approx(probe0))
    # a probe AR won after drafting (nothing verified) spent its draft; a lost bet leaves the probes' share alone
    assert allowance(200, ar, [{"probe": 1, "budget": 0, "draft_s": 0.005}])[1] == pytest.approx(1.5 * ar)
    bet_lost = {"probe": 0, "budget": 4, "committed": 1, "draft_s": 0.001, "verify_s": 0.02}
    bet, probe = allowance(200, ar, [bet_lost])
    assert probe == pytest.approx(probe0) and bet == pytest.approx(0.5 * (4.0 - 1.1) * ar)
    with pytest.raises(DFlashError, match="ar_s must be positive"):
        allowance(200, 0.0, [])


def test_a_stalled_step_spends_at_most_twice_what_it_was_expected_to():
    """The allowance bounds what wrong bets lose, not the machine's noise: a tree that won (16 tokens) but whose
    verify stalled 100 ms on a loaded machine, 40 AR steps, had spent a 256-token request's whole allowance (5
    AR steps) and left its later steps AR (test_oracle_drafter_makes_auto_speculate failed so under load).  Its
    time now counts at most twice what the step was expected to cost; a step expected to lose still loses."""
    ar = 0.0025
    bet0, _ = allowance(256, ar, [])
    stalled = {"probe": 0, "budget": 16, "committed": 16, "draft_s": 0.001, "verify_s": 0.100}
    assert allowance(256, ar, [stalled])[0] == 0.0                       # unbounded: the request's bets end
    capped = dict(stalled, expected_s=0.006)                             # 2.4 AR steps expected, 4.8 counted
    assert allowance(256, ar, [capped])[0] == pytest.approx(bet0 + 0.5 * (16 - 4.8) * ar)
    # a loss the step was expected to make is not forgiven: a 1-token tree costing 1.5 AR steps, as expected
    lost = {"probe": 0, "budget": 8, "committed": 1, "draft_s": 0.001, "verify_s": 0.00275, "expected_s": 0.00375}
    assert allowance(256, ar, [lost])[0] == pytest.approx(bet0 - 0.5 * 0.5 * ar)
    # a declined step (AR won after drafting) counts its draft, bounded the same way
    declined = {"probe": 0, "budget": 0, "draft_s": 0.050, "expected_s": 0.001}
    assert allowance(256, ar, [declined])[0] == pytest.approx(bet0 - 0.5 * 0.8 * ar)


def worst_loss(ar_s, verify: dict[int, float], *, draft_s=0.0, tree_s=0.0, commit_s=0.0, slots=1):
    ffi, lib = load()
    out = ffi.new("double*")
    check(lib.dfl_auto_worst_loss(estimates(ar_s, verify, draft_s=draft_s, tree_s=tree_s, commit_s=commit_s), slots, out))
    return out[0]


def test_a_shared_step_prices_a_bet_for_every_slot():
    """A bet's worst case (the allowance must cover it before auto drafts) in a step shared by 4 slots: every
    slot waits the draft, so it counts 4 times, and a 2-node verify timed alone (the warm-up's) below the
    batch's AR step is no saving.  Before, the verify's 'saving' cancelled the draft: a worst case of 0 passed
    any allowance, even a spent one, and on the bundled pair 4 auto slots drafted 8 ms blocks (4 AR steps) every
    few steps and lost every tree (0.79x the 4 AR slots on a Zen 3)."""
    ar_batch, v2_alone, draft = 2.0e-3, 1.06e-3, 0.66e-3
    assert worst_loss(ar_batch, {2: v2_alone}, draft_s=draft) == pytest.approx(draft)
    assert worst_loss(ar_batch, {2: v2_alone}, draft_s=draft, slots=4) == pytest.approx(4 * draft)
    # alone, a 2-node verify dearer than AR adds its extra, as before
    assert worst_loss(1.0e-3, {2: 1.2e-3}, draft_s=draft, tree_s=1e-4) == pytest.approx(draft + 1e-4 + 0.2e-3)
    with pytest.raises(DFlashError, match="slots must be at least 1"):
        worst_loss(ar_batch, {}, slots=0)


def test_verify_costs_are_measured_at_load():
    """The warm-up times the verify forward of every tree size auto may choose (2, 4, 8, 16 and the default
    budget's 23 nodes) and gives them to every drafter of the portfolio, so a first tree of a size is priced by
    a measurement; without the warm-up nothing is known until trees of those sizes have run."""
    with Decoder(draft=[str(bundled_pair()[1]), "lookup"], threads=2) as d:
        for k in (0, 1):
            v = d._ctx.auto_estimates(k)["verify_s"]
            assert {2, 4, 8, 16, 23} <= set(v) and all(t > 0 for t in v.values())
    with Decoder(draft="lookup", threads=2, warm_up=False) as d:
        assert d._ctx.auto_estimates(0)["verify_s"] == {}


# ---------------------------------------------------------------- decoding: exact whatever it chooses

@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("auto_draft"), n_layers=1, block_size=16, seed=9)


@pytest.mark.parametrize("drafter", ["distilled", "random"])
@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_auto_equals_ar_greedy(tiny_f32_gguf, ar_tokens, random_draft, drafter, kv):
    path = DISTILLED if drafter == "distilled" else random_draft
    with Decoder(tiny_f32_gguf, path, kv_type=kv, ctx=1024, threads=2) as d:
        assert d.default_mode == "auto"
        for _ in range(2):  # the controller keeps its estimates across requests
            r = d.generate(TRAIN_PROMPT, 96, ignore_eos=True)
            s = r.stats
            assert s.mode == "auto" and r.tokens == ar_tokens(TRAIN_PROMPT, kv, 96)
            assert len(s.auto_budget) == s.steps and all(0 <= b <= 22 for b in s.auto_budget)
            assert s.tree_size == s.auto_budget and s.target_forwards == [1] * s.steps
            assert sum(s.accept_lengths) + 1 == 96
            assert all(a == 1 for a, b in zip(s.accept_lengths, s.auto_budget) if b == 0)
            assert s.auto_summary.startswith(f"{s.auto_budget.count(0)} AR + ")


def test_auto_equals_ar_sampled(tiny_f32_gguf):
    kw = dict(temperature=0.8, top_p=0.95, seed=7)
    with Decoder(tiny_f32_gguf, DISTILLED, kv_type="f32", threads=2) as d:
        ar = d.generate(TRAIN_PROMPT, 64, ignore_eos=True, mode="ar", **kw)
        auto = d.generate(TRAIN_PROMPT, 64, ignore_eos=True, mode="auto", **kw)
    assert auto.tokens == ar.tokens


def test_a_constraints_masks_are_priced_per_step():
    """Under a constraint a step's masks are host time of that step: an AR step's (the root) and a tree's (every
    drafted node: up to 3x the budget under pruning) are priced beside the forward, and only then.  Verify 2 / 4
    nodes at 1.2 / 1.6 AR steps, a 3-node chain at 0.9 (3.4 tokens): a tree; the same with the tree's masks at 4
    AR steps and AR's at 0.4: AR; with masks as dear for both: the tree again."""
    verify = {2: 1.2e-3, 4: 1.6e-3}
    depth, p = chain(3, 0.9)
    assert choose(1e-3, verify, depth, p)[0] == 3
    b, _, tok_s, ar_tok_s = choose(1e-3, verify, depth, p, masks=(0.4e-3, 4e-3))
    assert b == 0 and ar_tok_s == pytest.approx(1 / 1.4e-3)
    assert choose(1e-3, verify, depth, p, masks=(0.4e-3, 0.4e-3))[0] == 3
    ffi, lib = load()
    worst = ffi.new("double*")
    check(lib.dfl_auto_worst_loss(estimates(1e-3, verify, masks=(0.4e-3, 4e-3)), 1, worst))
    assert worst[0] == pytest.approx(0.2e-3 + 3.6e-3)   # the 2-node verify's extra, the tree's masks beyond AR's


def test_a_constraints_masks_stay_out_of_the_drafters_costs():
    """A constrained request's masks are learnt apart (mask_ar_s, mask_tree_s) and priced only while a request
    has a constraint: the drafter's tree cost stays what it is without one, so the next plain request speculates
    as before (on the bundled pair a lookup tree's masks under a grammar cost ~2 ms, a hundred times its tree)."""
    grammar = 'root ::= [a-zA-Z_ .,:()=\\n#"]{1,600}'
    prompt = "import os\nimport sys\n" * 3 + "import os\nimport"
    with Decoder(draft="lookup", threads=2) as d:
        plain_ar = d.generate(prompt, 64, mode="ar", ignore_eos=True, cache=False)
        d.generate(prompt, 64, mode="auto", ignore_eos=True, cache=False)
        before = d._ctx.auto_estimates(0)
        assert not before["constrained"] and before["mask_ar_s"] == 0
        ar = d.generate(prompt, 64, mode="ar", grammar=grammar, cache=False)
        r = d.generate(prompt, 64, mode="auto", grammar=grammar, cache=False)
        assert r.tokens == ar.tokens
        during = d._ctx.auto_estimates(0)
        assert during["constrained"] and during["mask_ar_s"] > 0
        assert during["tree_s"] < 5 * max(before["tree_s"], 1e-5)
        r = d.generate(prompt, 64, mode="auto", ignore_eos=True, cache=False)
        assert r.tokens == plain_ar.tokens and not d._ctx.auto_estimates(0)["constrained"]


def test_oracle_drafter_makes_auto_speculate(tiny_f32_gguf, ar_tokens):
    prompt = [5, 17, 300, 1200, 41]
    # 256 tokens: a request's bets may lose 2% of its AR time, and the first ones are sized to it (on a loaded
    # machine 2% of 128 AR steps left some early steps AR, a 16-node tree's worst case above what was left)
    want = ar_tokens(prompt, "f32", 256)
    with Decoder(tiny_f32_gguf, kv_type="f32", ctx=1024, threads=2) as d:
        attach_oracle(d, prompt, want)
        r = d.generate(prompt, 256, ignore_eos=True, mode="auto", block_size=16)
        s = r.stats
        assert r.tokens == want
        spec = [b for b in s.auto_budget if b > 0]
        # after the AR step and the probe that measure the costs, the steps speculate and accept it all (a step
        # may still go AR when a stalled verify on a loaded machine prices its worst case above the allowance)
        assert len(spec) >= 0.8 * (s.steps - 2) and s.mean_accept > 6, s.auto_budget
        # the oracle's chain (15 deep at block 16) comes first in every tree; a budget past it adds nodes the
        # oracle gives no chance (auto rarely picks one, on timing noise alone), so the accepted part is the chain
        assert all(a == min(b, 15) + 1 for a, b in zip(s.accept_lengths[2:-1], s.auto_budget[2:-1])), \
            (s.accept_lengths, s.auto_budget)
        # a block is cut to the tokens still to come: a short request's drafts are learnt under their own rows
        # (a request's last step drafts what is left: 88 and 93 tokens, 16 a step, leave 8 and 13 for it, 9 and
        # 14 rows; a request of 40 tokens, its allowance 2% of 40 AR steps, does not always afford even the
        # oracle's cheap bet on a loaded machine)
        for n in (88, 93):
            assert d.generate(prompt, n, ignore_eos=True, mode="auto", block_size=16).tokens == want[:n]
        rows = d._ctx.auto_estimates()["draft_rows_s"]
        assert 16 in rows and min(rows) < 16, rows
        d._ctx.set_topk_hook(None)
        with pytest.raises(DFlashError, match="needs a drafter"):
            d.generate(prompt, 4, mode="auto")


def test_auto_stats_through_the_cli(tmp_path, tiny_f32_gguf):
    import json
    import subprocess
    import sys
    base = [sys.executable, "-m", "dflash27b.cli", "generate", "-m", str(tiny_f32_gguf), "-md", str(DISTILLED),
            "--prompt-ids", ",".join(map(str, TRAIN_PROMPT)), "-n", "32", "--ignore-eos", "-t", "2"]
    r = subprocess.run(base + ["--json"], capture_output=True, text=True)
    s = json.loads(r.stdout)["stats"]
    assert s["mode"] == "auto" and len(s["auto_budget"]) == len(s["est_tok_s"]) == len(s["accept_lengths"])
    assert all(not math.isnan(x) for x in s["est_ar_tok_s"])
    r = subprocess.run(base + ["--compare"], capture_output=True, text=True)
    assert r.returncode == 0 and "[auto cpu]" in r.stderr and "auto: " in r.stderr and "same tokens: True" in r.stderr


def test_the_first_probe_is_priced_at_load():
    """A drafter that costs many AR steps (the bundled DFlash2 one on a CPU: its block forward and selector
    against a tiny target's step) is measured at load, so a short request's auto decode does not open with a
    probe and keeps AR's speed; without the warm-up the second step was always a probe.  With it, the first
    probe waits at least AutoController::kMinProbeGap (8) steps, then as long as the loss the warm-up's probe
    measured needs to fit the request's share: whether a 64-token request affords one depends on that timing
    (on a busy machine sometimes it does), so only the first 8 steps are asserted, and that nothing but a
    probe speculates unless it expected to beat AR by the controller's margin (AutoController::kSpecGain, 10%;
    under load, the drafter's cost measured at load against a slowed AR step, a small tree sometimes does)."""
    with Decoder(device="cpu", threads=2) as d:
        s = d.generate("def f(x):\n", 64, ignore_eos=True, mode="auto").stats
        assert not any(s.probe[:8]), s.probe
        bets = [(e, a) for b, p, e, a in zip(s.auto_budget, s.probe, s.est_tok_s, s.est_ar_tok_s) if b and not p]
        assert all(e > a * (1.0 + 0.1) for e, a in bets), (s.probe, s.auto_budget, bets)
    with Decoder(device="cpu", threads=2, warm_up=False) as d:
        s = d.generate("def f(x):\n", 64, ignore_eos=True, mode="auto").stats
        assert s.probe[1] and s.auto_budget[0] == 0


def test_the_warm_up_prices_a_whole_block():
    """A block drafter's forward grows with its rows (the bundled DFlash2 one on a CPU: a 16-row block costs
    ~4x a 4-row one), and auto mode prices a draft by the rows of the block it would draft (draft_rows_s,
    interpolated; draft_s is the block being decided).  The warm-up's probe drafts a whole block, as a request's
    step does: it had drafted the 3 rows left at the end of its 4-token decode, and the requests' probes and
    bets were then priced at a quarter of their cost."""
    with Decoder(device="cpu", threads=2) as d:
        e = d._ctx.auto_estimates()
        block = d.draft_info["block_size"]
        assert list(e["draft_rows_s"]) == [block] and e["draft_s"] == e["draft_rows_s"][block] > 0, e
