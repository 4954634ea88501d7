"""Prompt lookup's tree joined to a model drafter's (csrc/spec/tree_merge.cpp), against the same portfolio without
the union, on agent-shaped edits of files in the context.

The bundled DFlash2 drafter and MTP head seldom draft on a CPU (their forward costs more than their tokens win
there), so the union seldom forms with them (bench/results/portfolio-merge-cpu-zen3.json).  This bench stands in
a model drafter that does draft: the context's top-k hook, right for the first --right tokens of each block (the
target's own AR continuation) and wrong below with less confidence, taking --wait seconds a draft, as a drafter
whose first tokens are good and whose forward costs a fraction of an AR step.  Two decoders of the bundled
target with prompt lookup and that drafter, one with the union (the default) and one without
(DFLASH27B_TREE_MERGE=0); every request runs AR and auto on each, back to back, in alternating order.  Reports
decode tok/s against AR on the same decoder, accept length, the steps whose verify held lookup's nodes, and
checks every reply against AR's.

    python bench/tree_merge_cpu.py [--threads 2] [--new 128] [--reps 4] [--right 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from ar import cpu_name  # noqa: E402
from portfolio_cpu import agent  # noqa: E402

from dflash27b import Decoder  # noqa: E402
from dflash27b.tools.oracle_draft import NearRootOracle  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--right", type=int, default=2, help="depths the stand-in drafter gets right")
    ap.add_argument("--wait", type=float, default=2e-4, help="seconds a draft of the stand-in drafter takes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tree-merge-cpu.json"))
    a = ap.parse_args(argv)
    reqs = [r for r in agent() if "tools" not in r]   # (a constraint's masks price trees out on a CPU)
    decs, hooks = {}, {}
    for name in ("union", "no union"):
        if name == "no union":
            os.environ["DFLASH27B_TREE_MERGE"] = "0"   # read when the decoder's generator is made
        decs[name] = Decoder(draft="lookup", threads=a.threads)
        os.environ.pop("DFLASH27B_TREE_MERGE", None)
        hooks[name] = NearRootOracle([], decs[name].info["n_vocab"], a.right, a.wait)
        decs[name]._ctx.set_topk_hook(hooks[name])
    print(f"machine: {cpu_name()}, {a.threads} threads; {len(reqs)} requests x {a.reps} passes, {a.new} new tokens; "
          f"stand-in drafter right at {a.right} depths, {a.wait * 1e3:.2f} ms a draft")
    acc = {n: {"ar_s": 0.0, "auto_s": 0.0, "tokens": 0, "accept": [], "with_lookup": 0, "steps": 0, "equal": True,
               "per_request": []} for n in decs}
    try:
        # what the stand-in drafter knows: each request's AR continuation (the same on every decoder)
        first = next(iter(decs.values()))
        known = []
        for r in reqs:
            kw = {k: v for k, v in r.items() if k != "prompt"}
            ar = first.generate(r["prompt"], a.new, mode="ar", ignore_eos=True, cache=False, **kw)
            known.append(list(ar.prompt_tokens) + ar.tokens)
        for rep in range(a.reps):
            for i, r in enumerate(reqs):
                kw = {k: v for k, v in r.items() if k != "prompt"}
                for name, dec in decs.items():
                    hooks[name].seq = known[i]
                    res = {}
                    for side in (("ar", "auto") if (rep + i) % 2 == 0 else ("auto", "ar")):
                        res[side] = dec.generate(r["prompt"], a.new, mode=side, ignore_eos=True, cache=False, **kw)
                    x, ar = acc[name], res["ar"]
                    s = res["auto"].stats
                    x["ar_s"] += ar.stats.decode_s
                    x["auto_s"] += s.decode_s
                    x["tokens"] += s.generated_tokens
                    x["accept"] += s.accept_lengths
                    x["with_lookup"] += sum(m > 0 for m in s.merged)
                    x["steps"] += s.steps
                    x["equal"] &= res["auto"].tokens == ar.tokens == known[i][len(ar.prompt_tokens):]
                    x["per_request"].append(round(ar.stats.decode_s / s.decode_s, 3))
    finally:
        for dec in decs.values():
            dec.close()
    doc = {"bench": "tree_merge_cpu", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "threads": a.threads,
           "new_tokens": a.new, "reps": a.reps, "right": a.right, "wait_s": a.wait, "requests": len(reqs), "rows": {}}
    for name, x in acc.items():
        row = {"vs_ar": round(x["ar_s"] / x["auto_s"], 3), "tok_s": round(x["tokens"] / x["auto_s"], 1),
               "accept_length": round(sum(x["accept"]) / len(x["accept"]), 3),
               "steps_with_lookup_added": x["with_lookup"], "steps": x["steps"], "equals_ar": x["equal"],
               "min_request_vs_ar": min(x["per_request"]), "request_vs_ar": x["per_request"]}
        doc["rows"][name] = row
        print(f"  {name:9s} {row['tok_s']:8.1f} tok/s  {row['vs_ar']:.2f}x AR  accept {row['accept_length']:.2f}  "
              f"steps with lookup's nodes {row['steps_with_lookup_added']}/{row['steps']}  "
              f"min request {row['min_request_vs_ar']:.2f}x  == AR {row['equals_ar']}")
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
