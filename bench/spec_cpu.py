"""CPU speculative-decoding benchmark on the tiny target + its distilled DFlash drafter.

Runs AR, chain and DDTree (a budget sweep) on the same prompts in one process and prints, per mode, the
mean accept length, the mean step time split into draft / tree build / verify / commit (and in AR
steps), tokens/s and the speedup over AR, and whether the output equals AR.  The target is the tests' tiny Qwen3.5 (8 layers, hidden 256) converted to GGUF F32; the drafter
is tests/fixtures/tiny_draft_distilled, and the prompts are ones it was distilled on (it memorised those
continuations; see its README), so acceptance is real but in-sample.

    python bench/spec_cpu.py [--threads 2] [--new 96] [--block 16]
    python bench/spec_cpu.py --target /tmp/dflash27b-bench/qwen35-0.8b-q4_k_m.gguf --random-draft
        (step cost split on a bandwidth-bound model; a random drafter of the target's width accepts ~1)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from dflash27b import Decoder  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from ar import cpu_name  # noqa: E402


def tiny_target(dirpath: Path) -> Path:
    from tiny_hf import make_tiny_hf

    from dflash27b.tools.convert import convert_hf_to_gguf
    out = dirpath / "tiny-f32.gguf"
    if not out.exists():
        hf = make_tiny_hf(dirpath / "hf", seed=0)
        convert_hf_to_gguf(hf, out, "f32")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budgets", default="4,8,16,22,32", help="ddtree budgets to sweep")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=ROOT / "tests" / "fixtures" / "tiny_draft_distilled")
    ap.add_argument("--random-draft", action="store_true", help="a random 1-layer drafter shaped for --target")
    a = ap.parse_args()
    tmp = Path(tempfile.gettempdir()) / "dflash27b-bench-tiny"
    tmp.mkdir(exist_ok=True)
    target = a.target or tiny_target(tmp)
    if a.random_draft:
        from tiny_draft import make_tiny_draft

        from dflash27b._handles import Model
        m = Model(str(target))
        i = m.info
        m.close()
        a.draft = make_tiny_draft(tmp / "random-draft", target_hidden=i["n_embd"], target_layers=i["n_layer"],
                                  vocab=i["n_vocab"], n_layers=1, block_size=16, n_head=8, n_head_kv=2,
                                  head_dim=128, ffn=3 * i["n_embd"])
    rng = np.random.default_rng(0)  # the fixture drafter's training prompts
    prompts = [rng.integers(0, 2047, 16).tolist() for _ in range(a.prompts)]
    budgets = [int(x) for x in a.budgets.split(",") if x]
    with Decoder(target, a.draft, kv_type="f32", threads=a.threads) as d:
        print(f"# target {target.name} ({d.info['weight_bytes'] / 1e9:.3f} GB weights), drafter {a.draft}")
        d.generate(prompts[0], 8, ignore_eos=True, mode="ar")  # warm-up
        ar_tok = ar_s = 0.0
        refs = []
        for p in prompts:
            ra = d.generate(p, a.new, ignore_eos=True, mode="ar")
            refs.append(ra.tokens)
            ar_tok += ra.stats.generated_tokens - 1
            ar_s += ra.stats.decode_s
        ar_step = ar_s / ar_tok * 1e3
        configs = [("chain", dict(mode="chain", block_size=a.block))]
        configs += [(f"ddtree {b}", dict(mode="ddtree", block_size=a.block, budget=b)) for b in budgets]
        rows = []
        for name, kw in configs:
            tok = sec = 0.0
            dr, tr, ve, co, acc, same = [], [], [], [], [], True
            for p, ref in zip(prompts, refs):
                r = d.generate(p, a.new, ignore_eos=True, **kw)
                same &= r.tokens == ref
                tok += r.stats.generated_tokens - 1
                sec += r.stats.decode_s
                dr += r.stats.draft_ms
                tr += r.stats.tree_ms
                ve += r.stats.verify_ms
                co += r.stats.commit_ms
                acc += r.stats.accept_lengths
            rows.append((name, np.mean(acc), np.mean(dr), np.mean(tr), np.mean(ve), np.mean(co), tok / sec, same))
    print(f"# CPU: {cpu_name()}, {a.threads} threads; block {a.block}; {a.prompts} prompts x {a.new} tokens; "
          f"AR step {ar_step:.3f} ms, AR {ar_tok / ar_s:.1f} tok/s")
    print("| mode | mean accept | draft | tree build | verify | commit | step (x AR) | tok/s | speedup | == AR |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, m, dr, tr, ve, co, tps, same in rows:
        step = dr + tr + ve + co
        print(f"| {name} | {m:.2f} | {dr:.2f} ms | {tr:.3f} ms | {ve:.2f} ms | {co:.3f} ms | {step:.2f} ms "
              f"({step / ar_step:.2f}x) | {tps:.1f} | {tps / (ar_tok / ar_s):.2f}x | {same} |")


if __name__ == "__main__":
    main()
