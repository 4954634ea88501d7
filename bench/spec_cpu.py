"""CPU speculative-decoding benchmark on the tiny target + its distilled DFlash drafter.

Runs AR and chain decoding on the same prompts in one process and prints the mean time of a chain step
split into draft / verify / commit, the mean accept length, and AR vs chain tokens/s (their ratio is the
speedup).  The target is the tests' tiny Qwen3.5 (8 layers, hidden 256) converted to GGUF F32; the drafter
is tests/fixtures/tiny_draft_distilled, and the prompts are ones it was distilled on (it memorised those
continuations; see its README), so acceptance is real but in-sample.

    python bench/spec_cpu.py [--threads 2] [--new 96] [--block 16]
    python bench/spec_cpu.py --target /tmp/dflash27b-bench/qwen35-0.8b-q4_k_m.gguf --random-draft
        (step cost split on a bandwidth-bound model; a random drafter of the target's width accepts ~1)
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from dflash27b import Decoder  # noqa: E402


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
    with Decoder(target, a.draft, kv_type="f32", threads=a.threads) as d:
        print(f"# target {target.name} ({d.info['weight_bytes'] / 1e9:.3f} GB weights), drafter {a.draft}")
        d.generate(prompts[0], 8, ignore_eos=True, mode="ar")  # warm-up
        ar_tok = ar_s = sp_tok = sp_s = 0.0
        dr, ve, co, acc, same = [], [], [], [], True
        for p in prompts:
            ra = d.generate(p, a.new, ignore_eos=True, mode="ar")
            rc = d.generate(p, a.new, ignore_eos=True, mode="chain", block_size=a.block)
            same &= ra.tokens == rc.tokens
            ar_tok += ra.stats.generated_tokens - 1
            ar_s += ra.stats.decode_s
            sp_tok += rc.stats.generated_tokens - 1
            sp_s += rc.stats.decode_s
            dr += rc.stats.draft_ms
            ve += rc.stats.verify_ms
            co += rc.stats.commit_ms
            acc += rc.stats.accept_lengths
        ar_step = ar_s / ar_tok * 1e3
    print(f"# tiny pair on CPU: {platform.processor() or platform.machine()}, {a.threads} threads, "
          f"block {a.block}, {a.prompts} prompts x {a.new} tokens; chain output == AR: {same}")
    print("| | ms | x AR step |")
    print("|---|---:|---:|")
    for name, v in (("AR step", [ar_step]), ("chain draft", dr), ("chain verify", ve), ("chain commit", co)):
        print(f"| {name} | {np.mean(v):.3f} | {np.mean(v) / ar_step:.2f} |")
    step = np.mean(dr) + np.mean(ve) + np.mean(co)
    print(f"| chain step (sum) | {step:.3f} | {step / ar_step:.2f} |")
    print(f"\nmean accept length {np.mean(acc):.2f}; AR {ar_tok / ar_s:.1f} tok/s, chain {sp_tok / sp_s:.1f} tok/s, "
          f"speedup {sp_tok / sp_s / (ar_tok / ar_s):.2f}x")


if __name__ == "__main__":
    main()
