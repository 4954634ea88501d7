"""Auto mode vs AR (and fixed DDTree) on CPU: the acceptance runs of "never slower than AR".

Three cases, each run `--repeats` times with the modes interleaved, every run in a fresh Decoder (auto
starts with no estimates, as a new `dflash27b generate` process does); medians of decode tok/s:

  bundled  the bundled pair, "def fibonacci(n):", 128 new tokens: the README's first command
  tiny     the tests' tiny target (tests/tiny_hf.py, F32) with its distilled drafter, on a prompt the
           drafter was distilled on (tests/fixtures/tiny_draft_distilled)
  oracle   the bundled target with the oracle drafter (dflash27b.tools.oracle_draft: a top-k hook that
           proposes the target's own AR continuation): speculation must win, auto must choose it

Every run's tokens are checked against AR's.  Writes bench/results/auto-cpu.json and prints a table.
On a GPU (acceptance 4 of the auto-mode issue: auto within 5% of the best fixed budget with the oracle
drafter on the synthetic 27B), `--device cuda --cases oracle --oracle-target 27b.gguf --budgets 8,16,22,32`
(make the file with `dflash27b synth 27b.gguf --shape 27b --ftype q4_k_m`); the table then names the best
fixed budget and auto's ratio to it.

    python bench/auto_cpu.py [--threads 2] [--repeats 3] [--new 128] [--device cpu|cuda] [--cases ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from ar import cpu_name  # noqa: E402
from spec_cpu import tiny_target  # noqa: E402

from dflash27b import Decoder  # noqa: E402
from dflash27b.decoder import bundled_pair  # noqa: E402
from dflash27b.tools.oracle_draft import attach_oracle  # noqa: E402

DISTILLED = ROOT / "tests" / "fixtures" / "tiny_draft_distilled"


def run_case(name: str, target, draft, prompt: list[int] | str, modes: list[str], n_new: int, threads: int,
             repeats: int, oracle: bool = False, device: str = "cpu") -> dict:
    with Decoder(target, draft, threads=threads, device=device) as dec:
        ids = dec.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        ref = dec.generate(ids, n_new, ignore_eos=True, mode="ar").tokens
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    max_budget = max([int(m.split("-")[1]) for m in modes if "-" in m] or [22])
    for _ in range(repeats):
        for mode in modes:  # interleaved: drift in the machine's speed hits every mode alike
            with Decoder(target, None if oracle else draft, threads=threads, device=device) as dec:
                if oracle and mode != "ar":
                    attach_oracle(dec, ids, ref)
                kw = dict(mode=mode.split("-")[0], budget=int(mode.split("-")[1]) if "-" in mode else max_budget)
                if oracle and mode != "ar":
                    kw["block_size"] = 16
                r = dec.generate(ids, n_new, ignore_eos=True, **kw)
            s = r.stats
            runs[mode].append({"tok_s": s.decode_tok_s, "same_as_ar": r.tokens == ref, "mean_accept": s.mean_accept,
                               "auto": s.auto_summary})
    out = {"case": name, "prompt_tokens": len(ids), "new_tokens": n_new, "modes": {}}
    ar_med = statistics.median(x["tok_s"] for x in runs["ar"])
    for mode, rs in runs.items():
        med = statistics.median(x["tok_s"] for x in rs)
        out["modes"][mode] = {"tok_s": [round(x["tok_s"], 2) for x in rs], "median_tok_s": round(med, 2),
                              "vs_ar": round(med / ar_med, 3), "same_as_ar": all(x["same_as_ar"] for x in rs),
                              "mean_accept": round(statistics.median(x["mean_accept"] for x in rs), 2),
                              "auto_choices": [x["auto"] for x in rs if x["auto"]]}
    fixed = {m: v["median_tok_s"] for m, v in out["modes"].items() if m.startswith("ddtree")}
    if fixed and "auto" in out["modes"]:
        best = max(fixed, key=fixed.get)
        out["best_fixed"] = best
        out["auto_vs_best_fixed"] = round(out["modes"]["auto"]["median_tok_s"] / fixed[best], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "auto-cpu.json"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--cases", default="bundled,tiny,oracle")
    ap.add_argument("--oracle-target", default=None, help="GGUF for the oracle case [default: the bundled target]")
    ap.add_argument("--budgets", default="22", help="fixed DDTree budgets to run (auto may choose up to the largest)")
    a = ap.parse_args(argv)
    t_bundled, d_bundled = bundled_pair()
    budgets = [int(b) for b in a.budgets.split(",")]
    modes = ["ar", "auto"] + [f"ddtree-{b}" for b in budgets]
    want = a.cases.split(",")
    cases = []
    if "bundled" in want:
        cases.append(run_case("bundled", t_bundled, d_bundled, "def fibonacci(n):", modes, a.new, a.threads,
                              a.repeats, device=a.device))
    if "tiny" in want:
        with tempfile.TemporaryDirectory() as tmp:
            t_tiny = tiny_target(Path(tmp))
            prompt = np.random.default_rng(0).integers(0, 2047, 16).tolist()
            cases.append(run_case("tiny", t_tiny, DISTILLED, prompt, modes, a.new, a.threads, a.repeats,
                                  device=a.device))
    if "oracle" in want:
        cases.append(run_case("oracle", a.oracle_target or t_bundled, None, "def fibonacci(n):", modes, a.new,
                              a.threads, a.repeats, oracle=True, device=a.device))
    doc = {"bench": "auto_cpu", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "device": a.device,
           "threads": a.threads, "repeats": a.repeats, "budgets": budgets, "cases": cases}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['cpu']}, {a.threads} threads, medians of {a.repeats} interleaved runs, {a.new} new tokens")
    print(f"{'case':8} {'mode':10} {'tok/s':>8} {'vs AR':>6} {'accept':>6}  same  auto's choices (last run)")
    ok = True
    for c in cases:
        for mode, m in c["modes"].items():
            ok &= m["same_as_ar"]
            print(f"{c['case']:8} {mode:10} {m['median_tok_s']:8.1f} {m['vs_ar']:6.2f} {m['mean_accept']:6.2f}  "
                  f"{'yes' if m['same_as_ar'] else 'NO ':4} {m['auto_choices'][-1] if m['auto_choices'] else ''}")
        if "best_fixed" in c:
            print(f"{c['case']:8} auto vs the best fixed budget ({c['best_fixed']}): {c['auto_vs_best_fixed']:.2f}")
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
