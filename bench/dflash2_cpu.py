"""DFlash vs DFlash2 drafters distilled the same way on the bundled target: which accepts more, and which is
faster, in chain mode and DDTree-22 (a DFlash2 tree built both ways: from its candidate selector's lattice
and from its draft probabilities alone), with AR alongside.

Both drafters come from `models/train/distill_draft.py` with the same data, steps and seed (the README of
`python/dflash27b/models/` gives the command; `--generation 2 --selector-rank 64` makes the DFlash2).  The
prompts are the held-out ones (`models/heldout_prompts.jsonl`, files the target never trained on), greedy,
128 new tokens each.  Every speculative run must equal AR token for token (checked, reported).  Reported per
row: mean accept length (tokens per step, the bonus included), tok/s, and the speedup over AR in the same run.

    python bench/dflash2_cpu.py [DFLASH2_DIR] [--dflash DIR] [--n-new 128] [--threads 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dflash27b import Decoder
from dflash27b.decoder import bundled_pair

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ar import cpu_name  # noqa: E402

ROWS = [("chain-16", dict(mode="chain", block_size=16)),
        ("ddtree-22, draft-probability tree", dict(mode="ddtree", budget=22, tree_scores="draft")),
        ("ddtree-22, selector tree", dict(mode="ddtree", budget=22, tree_scores="selector")),
        ("auto", dict(mode="auto"))]


def run(target: Path, draft: Path, prompts: list[str], n_new: int, threads: int, dflash2: bool) -> dict:
    out = {}
    with Decoder(target, draft, threads=threads) as d:
        t0, ar = time.perf_counter(), []
        for p in prompts:
            ar.append(d.generate(p, n_new, mode="ar", ignore_eos=True).tokens)
        ar_s = time.perf_counter() - t0
        out["ar"] = {"tok_s": round(n_new * len(prompts) / ar_s, 2)}
        for name, kw in ROWS:
            if "selector" in name and not dflash2:
                continue
            acc, same, t0 = [], True, time.perf_counter()
            for p, ref in zip(prompts, ar):
                r = d.generate(p, n_new, ignore_eos=True, **kw)
                same &= r.tokens == ref
                acc += r.stats.accept_lengths
            s = time.perf_counter() - t0
            key = name.replace(", draft-probability tree", "") if not dflash2 else name
            out[key] = {"accept_length": round(sum(acc) / len(acc), 3), "tok_s": round(n_new * len(prompts) / s, 2),
                        "speedup_vs_ar": round(ar_s / s, 3), "equals_ar": bool(same)}
            print(f"  {key:36s} accept {out[key]['accept_length']:.2f}  {out[key]['tok_s']:7.1f} tok/s  "
                  f"{out[key]['speedup_vs_ar']:.2f}x AR  == AR {same}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dflash2", nargs="?", default=None,
                    help="a DFlash2 drafter directory distilled on the bundled target (default: the bundled one)")
    ap.add_argument("--dflash", default=None, help="the DFlash drafter to compare (default: the bundled one)")
    ap.add_argument("--n-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    target, _ = bundled_pair()
    dflash = Path(a.dflash) if a.dflash else target.parent / "tiny-draft"
    dflash2 = Path(a.dflash2) if a.dflash2 else target.parent / "tiny-draft2"
    prompts = [json.loads(x)["prompt"] for x in (ROOT / "models/heldout_prompts.jsonl").read_text().splitlines()
               if x.strip()]
    print(f"machine: {cpu_name()}, {a.threads} threads; {len(prompts)} held-out prompts x {a.n_new} tokens")
    doc = {"bench": "dflash2_cpu", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
           "threads": a.threads, "n_new": a.n_new, "prompts": len(prompts), "target": str(target.name)}
    for label, path, gen2 in (("dflash", dflash, False), ("dflash2", dflash2, True)):
        print(f"{label}: {path}", flush=True)
        doc[label] = {"drafter": str(path), **run(target, path, prompts, a.n_new, a.threads, gen2)}
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
