"""CPU autoregressive decode, prefill and verify cost on a synthetic Qwen3.5-0.8B-shaped Q4_K_M.

Prints prefill and decode tok/s (medians of --reps runs) with the thread count,
bytes read per token, the machine's measured read bandwidth and the fraction of
the bandwidth floor reached; the verify-cost curve: one target forward of n
draft tokens (every row's logits, nothing committed, as speculation verifies)
in AR steps (one committed token with its logits), n = 1..32, after a 512-token
context; if llama-cpp-python is installed, times llama.cpp's prefill and decode
on the same file in the same run and prints the ratios.

    python bench/ar.py [--model PATH] [--threads 2] [--prefill 512] [--decode 64] [--json OUT]

Where the CPU has AVX-512 VNNI its batch kernels run (the record's `build` says "cpu: avx2+avx512");
DFLASH27B_CPU_AVX512=0 in the environment times the AVX2 kernels instead (same bits).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from dflash27b import Decoder
from dflash27b._handles import Context, Model
from dflash27b._lib import load

VERIFY_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU as a record must name it: a VM's model name ("AMD EPYC") covers Zen 1 to Zen 4, whose
    integer SIMD throughput differs 2-4x, so the family / model numbers and SIMD flags go with it."""
    fields: dict[str, str] = {}
    try:
        for line in open(cpuinfo):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break  # the first processor's block is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown cpu"
    if "cpu family" in fields:
        flags = set(fields.get("flags", "").split())
        simd = " ".join(f for f in SIMD_FLAGS if f in flags) or "no AVX2"
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')}; {simd})"
    return name


def ensure_model(path: Path, shape: str) -> Path:
    if not path.exists():
        from dflash27b.tools.synth import write_synthetic
        print(f"writing synthetic {shape} Q4_K_M to {path} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, shape, "q4_k_m", seed=0, random_quant=True)
    return path


def bench_ours(model: Path, threads: int, prompt: list[int], n_decode: int, reps: int) -> dict:
    with Decoder(model, threads=threads, ctx=len(prompt) + n_decode + 8, kv_type="f16") as d:
        d.generate(prompt[:8], 4, ignore_eos=True)  # warm-up: page in the weights
        runs = [d.generate(prompt, n_decode, ignore_eos=True) for _ in range(reps)]
        return {"prefill_tok_s": float(np.median([r.stats.prefill_tok_s for r in runs])),
                "decode_tok_s": float(np.median([r.stats.decode_tok_s for r in runs])),
                "weight_bytes": d.info["weight_bytes"], "tokens": runs[0].tokens}


def median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def verify_curve(model: Path, threads: int, prompt: list[int], reps: int) -> dict:
    """ms of one AR step and of one n-token verify after the prompt, and their ratio.

    Each verify size is timed alternately with AR steps, and its ratio uses the AR
    steps timed beside it: a shared machine's speed drifts over a run, and a ratio
    of times taken minutes apart would measure the drift."""
    m = Model(str(model))
    vocab = min(m.info["n_vocab"], 240000)
    ctx = Context(m, n_ctx=len(prompt) + 64, n_batch=512, n_threads=threads, kv_type=1)  # f16 KV
    ctx.forward(prompt, logit_rows=[len(prompt) - 1])
    rng = np.random.default_rng(1)
    past = ctx.n_past

    def ar_step():
        ctx.forward([int(rng.integers(0, vocab))], logit_rows=[0])
        ctx.set_n_past(past)  # the same position every time (its KV row is rewritten)
    ar_step()
    out = {"context": len(prompt), "verify": []}
    all_ar = []
    for n in VERIFY_SIZES:
        toks = rng.integers(0, vocab, size=n).tolist()
        ctx.forward(toks, logit_rows=list(range(n)), commit=False)  # warm-up at this size
        ar, ver = [], []
        for _ in range(2 * reps + 1):
            ar.append(median_time(ar_step, 1))
            ver.append(median_time(lambda: ctx.forward(toks, logit_rows=list(range(n)), commit=False), 1))
        a, v = float(np.median(ar)), float(np.median(ver))
        all_ar += ar
        out["verify"].append({"n": n, "ms": v * 1e3, "ar_ms": a * 1e3, "ar_steps": v / a})
    out["ar_step_ms"] = float(np.median(all_ar)) * 1e3
    return out


def bench_llama_cpp(model: Path, threads: int, prompt: list[int], n_decode: int, reps: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(model), n_threads=threads, n_threads_batch=threads,
                          n_ctx=len(prompt) + n_decode + 8, n_batch=512, verbose=False, logits_all=False)
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    llm.eval(prompt[:8])  # warm-up
    prefill = []
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - t0))
    tok = last_argmax()
    toks = [tok]
    t2 = time.perf_counter()
    for _ in range(n_decode - 1):
        llm.eval([tok])
        tok = last_argmax()
        toks.append(tok)
    t3 = time.perf_counter()
    return {"prefill_tok_s": float(np.median(prefill)), "decode_tok_s": (n_decode - 1) / (t3 - t2), "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF to run (default: synthetic, written once)")
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="runs per measurement (medians)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp even if installed")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    a = ap.parse_args()
    model = a.model or ensure_model(Path("/tmp/dflash27b-bench") / f"qwen35-{a.shape}-q4_k_m.gguf", a.shape)
    ffi, lib = load()
    bw = lib.dfl_measure_read_bandwidth(1 << 30, a.threads)
    n_vocab = Model(str(model)).info["n_vocab"]
    prompt = np.random.default_rng(0).integers(0, min(n_vocab, 240000), size=a.prefill).tolist()

    ours = bench_ours(model, a.threads, prompt, a.decode, a.reps)
    floor = bw * 1e9 / ours["weight_bytes"]
    curve = verify_curve(model, a.threads, prompt, a.reps)
    peer = None if a.no_peer else bench_llama_cpp(model, a.threads, prompt, a.decode, a.reps)

    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} cores; build: {ffi.string(lib.dfl_build_info()).decode()}")
    print(f"model: {model.name} ({model.stat().st_size / 1e9:.3f} GB file)")
    print(f"threads: {a.threads}   prefill: {a.prefill} tokens   decode: {a.decode} tokens")
    print(f"bytes read per token (weights): {ours['weight_bytes'] / 1e9:.3f} GB")
    print(f"measured read bandwidth ({a.threads} threads): {bw:.1f} GB/s -> floor {floor:.1f} tok/s")
    print(f"{'engine':12s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'of floor':>9s}")
    print(f"{'dflash27b':12s} {ours['prefill_tok_s']:14.1f} {ours['decode_tok_s']:13.2f} "
          f"{ours['decode_tok_s'] / floor:9.2f}")
    if peer:
        print(f"{'llama.cpp':12s} {peer['prefill_tok_s']:14.1f} {peer['decode_tok_s']:13.2f} "
              f"{peer['decode_tok_s'] / floor:9.2f}")
        print(f"ratio dflash27b / llama.cpp: prefill {ours['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x, "
              f"decode {ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x")
        same = sum(x == y for x, y in zip(ours["tokens"], peer["tokens"]))
        print(f"greedy tokens identical to llama.cpp: {same}/{len(ours['tokens'])} "
              f"(random synthetic weights make a chaotic net: activation-quantisation noise flips argmaxes; see tests/test_oracle_hf.py for exactness)")
    else:
        print("llama.cpp: not installed (pip install llama-cpp-python) — no peer row")
    print(f"\nverify cost after {curve['context']} tokens (one forward of n tokens, every row's logits, "
          f"in AR steps timed alternately with it; median AR step {curve['ar_step_ms']:.1f} ms):")
    print("  n        " + " ".join(f"{v['n']:>5d}" for v in curve["verify"]))
    print("  ms       " + " ".join(f"{v['ms']:5.0f}" for v in curve["verify"]))
    print("  AR ms    " + " ".join(f"{v['ar_ms']:5.1f}" for v in curve["verify"]))
    print("  AR steps " + " ".join(f"{v['ar_steps']:5.2f}" for v in curve["verify"]))
    if a.json:
        rec = {"machine": cpu_name(), "cores": os.cpu_count(), "build": ffi.string(lib.dfl_build_info()).decode(),
               "model": model.name, "threads": a.threads, "prefill_tokens": a.prefill, "decode_tokens": a.decode,
               "reps": a.reps, "read_bandwidth_gb_s": bw, "floor_tok_s": floor,
               "dflash27b": {k: v for k, v in ours.items() if k != "tokens"}, "verify_curve": curve,
               "llama_cpp": None if not peer else {k: v for k, v in peer.items() if k != "tokens"}}
        if peer:
            rec["ratio_prefill"] = ours["prefill_tok_s"] / peer["prefill_tok_s"]
            rec["ratio_decode"] = ours["decode_tok_s"] / peer["decode_tok_s"]
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
