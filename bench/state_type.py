"""What storing the delta-net recurrent state in BF16 or F16 costs in quality, against F32.

For each state type the same target decodes greedily from the same prompts; reported against the F32 run:
  * greedy agreement: the share of the F32 continuation reproduced before the first differing token,
    and the share of positions where the types' own greedy choice (teacher-forced on F32's tokens) agrees;
  * mean KL(F32 || type) of the next-token distributions along F32's sequence (teacher-forced).
Every type is exact on its own (speculative == AR with that state type; tests/test_state_type.py); this
measures how far the model moves from F32.

    python bench/state_type.py [--cases tiny,0.8b] [--new 512] [--ctx 2048] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from dflash27b import Decoder  # noqa: E402
from dflash27b.decoder import bundled_pair  # noqa: E402

TYPES = ("f32", "bf16", "f16")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def run_case(name: str, target: str, prompts: list[str], n_new: int, ctx: int, threads: int) -> dict:
    ref_tokens: dict[str, list[int]] = {}
    ref_logp: dict[str, np.ndarray] = {}
    rows = {}
    for st in TYPES:
        agree_prefix, agree_tf, kls, t0 = [], [], [], time.perf_counter()
        with Decoder(target, device="cpu", ctx=ctx, threads=threads, state_type=st) as d:
            for p in prompts:
                ids = d.tokenize(p)
                toks = d.generate(ids, n_new, ignore_eos=True, mode="ar").tokens
                if st == "f32":
                    ref_tokens[p] = toks
                ref = ref_tokens[p]
                seq = ids + ref
                lp = log_softmax(d.logits(seq)[len(ids) - 1:len(seq) - 1])  # next-token rows along F32's tokens
                if st == "f32":
                    ref_logp[p] = lp
                k = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref))
                agree_prefix.append(k / len(ref))
                agree_tf.append(float((lp.argmax(-1) == ref_logp[p].argmax(-1)).mean()))
                kls.append(float((np.exp(ref_logp[p]) * (ref_logp[p] - lp)).sum(-1).mean()))
        rows[st] = {"greedy_prefix_agreement": float(np.mean(agree_prefix)),
                    "teacher_forced_top1_agreement": float(np.mean(agree_tf)), "mean_kl": float(np.mean(kls)),
                    "seconds": time.perf_counter() - t0}
        print(f"{name:5} {st:5} prefix agreement {rows[st]['greedy_prefix_agreement']:.3f}  top-1 agreement "
              f"{rows[st]['teacher_forced_top1_agreement']:.4f}  mean KL {rows[st]['mean_kl']:.2e}", flush=True)
    return {"target": str(target), "prompts": len(prompts), "n_new": n_new, "ctx": ctx, "types": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="tiny,0.8b")
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "state-type-cpu.json"))
    a = ap.parse_args()
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef walk(path):\n", "class Stack:\n    def __init__(self):\n"]
    out = {}
    for case in a.cases.split(","):
        if case == "tiny":
            target = str(bundled_pair()[0])
        elif case == "0.8b":
            from ar import ensure_model
            target = str(ensure_model(ROOT / "build" / "synth-0.8b-q4_k_m.gguf", "0.8b"))
        else:
            raise SystemExit(f"unknown case {case!r}: tiny or 0.8b")
        n_new = a.new if case == "tiny" else min(a.new, a.ctx - 64)
        out[case] = run_case(case, target, prompts[:3 if case == "tiny" else 1], n_new, a.ctx, a.threads)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
