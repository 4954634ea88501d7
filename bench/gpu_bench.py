"""The GPU record: what one lent GPU machine measures, as bench/results/gpu-YYYYMMDD-HHMM.json + .md.

bench/gpu_bench.sh runs the parts below on the GPU machine; each part writes one JSON file into a parts
directory, and `record` assembles them, so a part that fails or runs out of time leaves the others'
numbers (its keys are then null).  Every part also runs on the CPU (`--device cpu`, the bundled pair):
tests/test_gpu_bench.py does exactly that, so the script is known to work before GPU time is spent.

  exact     the four exactness checks on the bundled pair: greedy AR on the device == AR on the CPU
            (a divergence only at a CPU logit near-tie), chain == AR, DDTree-22 == AR, seeded sampled
            DDTree == seeded AR, all on the device
  checks    parses the logs of the test and sanitizer runs: pytest's JUnit XML, the backend op test,
            compute-sanitizer memcheck / racecheck summaries
  llamacpp  llama.cpp's llama-bench on the same file (decode tg, prefill pp512 / pp8192, flash attention,
            every layer on the GPU), or its JSON output parsed
  ours      on the target (and drafter): AR decode and prefill, one AR step, verify by node count (chain
            and tree shapes), the drafter's block step, a whole DDTree-22 step, commit, tok/s with the
            oracle drafter at accept length ~8, the memory plan against the device peak, copy bandwidth,
            and on CUDA each op's GPU time per AR and DDTree-22 step and in the longest prefill
            (dfl_cuda_profile)
  draftmodel  classic draft-model speculation: a 0.8B-shaped qwen35 GGUF drafting for the 27B, step costs
  drafters  the 27B with an MTP head: the head's chain / DDTree steps, lookup and the portfolio of head, DFlash
            and lookup in auto mode; each drafter's draft and the verify by size in AR steps (issue 43's table)
  slots     several requests at once (Decoder.generate_many): N AR streams' aggregate decode tok/s vs one
            stream, N auto streams, every reply == its solo decode (issue 41: 4 streams >= 3.5x one)
  prefix    the prefix cache: turn 2 of an 8K-token conversation (turn 1 + reply + 24 tokens) vs turn 1,
            time to first token, == a cold decode
  vram24    the 24 GB card on a bigger GPU: a ballast leaves 24 GiB free; the 27B + drafter at 128K context,
            Q4_0 KV, DDTree-22 after a long prompt; peak vs plan vs cap, DDTree == AR on that run
  matmul    the CUDA matmul alone: GB/s per format and token count on the 27B's FFN shapes
  matvec    the K-quant matvec on every AR-step shape of the 27B, each rows-per-CTA choice and the automatic
            one, and the tensor-core verify (16, 23, 64 tokens; 512, a prefill chunk) by K split (issue 45: which kernel shape
            streams the weights fastest; every choice gives the same bits)
  record    the parts -> the record (keys below, null where a part is missing) + a markdown table

Record keys (other tools read them): device, commit, date, tests {passed, failed}, sanitizer
{memcheck_errors, racecheck_hazards}, exact {cuda_ar_eq_cpu_ar, chain_eq_ar, ddtree_eq_ar,
sampled_ddtree_eq_ar}, ar {decode_tok_s, prefill_512_tok_s, prefill_8192_tok_s}, llamacpp
{decode_tok_s, prefill_512_tok_s, prefill_8192_tok_s, build}, steps {ar_ms, verify_ms {nodes: ms},
verify_tree_ms {nodes: ms}, draft_ms, tree_ms, ddtree22_step_ms, commit_ms}, oracle {accept_length, tok_s,
speedup}, memory {plan_bytes, peak_bytes, plan}, copy_gb_s, vram24 {ctx, peak_bytes, plan_bytes, cap_bytes,
exact}, profile {ar, ddtree22, prefill_P: {steps, ms_per_step, ops [{op, ms_per_step, calls_per_step,
gb_s}]}}; plus
matmul, matvec {shape: {n: {auto|16|8|4|2|1: {ms, gb_s}, best}}}, mma_verify {shape: {n: {auto|w1|w2|w4|sync:
{ms, gb_s}, best}}}, target, draft and notes.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from spec_steps import NEAR_TIE, divergence  # noqa: E402  (where two backends part, and the logit margin)

VERIFY_NODES = (2, 4, 8, 16, 23, 32)
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(path):\n    for root, dirs, files in os.walk("]


def _median(xs) -> float | None:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else None


def _write(path: str | Path, obj: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    print(f"wrote {path}")


# ---------------------------------------------------------------------------------------------- exact
def part_exact(device: str, n_new: int, threads: int) -> dict:
    """The four exactness checks on the bundled pair, AR on the CPU as the cross-backend reference."""
    from dflash27b import Decoder
    from dflash27b.decoder import bundled_pair

    target, draft = bundled_pair()
    out: dict = {"n_new": n_new, "cuda_ar_eq_cpu_ar": True, "near_ties": []}
    with Decoder(target, draft, device=device, ctx=1024, threads=threads) as dev, \
            Decoder(target, draft, device="cpu", ctx=1024, threads=threads) as cpu:
        out["device"] = dev.backend
        for prompt in PROMPTS:
            ids = cpu.tokenize(prompt)
            a = dev.generate(ids, n_new, ignore_eos=True, mode="ar").tokens
            b = cpu.generate(ids, n_new, ignore_eos=True, mode="ar").tokens
            d = divergence(cpu, ids, a, b)
            if d is not None:
                k, margin = d
                out["near_ties"].append({"prompt": prompt, "token": k, "margin": margin})
                out["cuda_ar_eq_cpu_ar"] &= margin < NEAR_TIE
        ids = dev.tokenize(PROMPTS[1])
        ar = dev.generate(ids, n_new, ignore_eos=True, mode="ar").tokens
        out["chain_eq_ar"] = dev.generate(ids, n_new, ignore_eos=True, mode="chain").tokens == ar
        out["ddtree_eq_ar"] = dev.generate(ids, n_new, ignore_eos=True, mode="ddtree", budget=22).tokens == ar
        sampled = dict(ignore_eos=True, temperature=0.8, seed=7)
        out["sampled_ddtree_eq_ar"] = (dev.generate(ids, n_new, mode="ddtree", **sampled).tokens
                                       == dev.generate(ids, n_new, mode="ar", **sampled).tokens)
        if device == "cuda":  # graph mode (the default, in every check above) against each op issued on its own
            from dflash27b._lib import load

            ffi, lib = load()
            dd = dev.generate(ids, n_new, ignore_eos=True, mode="ddtree", budget=22).tokens
            lib.dfl_cuda_graph_mode(0)
            try:
                out["graphs_off_eq_on"] = (dev.generate(ids, n_new, ignore_eos=True, mode="ar").tokens == ar and
                                           dev.generate(ids, n_new, ignore_eos=True, mode="ddtree",
                                                        budget=22).tokens == dd)
            finally:
                lib.dfl_cuda_graph_mode(-1)
    return out


# --------------------------------------------------------------------------------------------- checks
def parse_junit(path: str | Path) -> dict:
    """passed / failed / skipped / xfailed from pytest's --junitxml file."""
    root = ET.parse(path).getroot()
    passed = failed = skipped = xfailed = 0
    for case in root.iter("testcase"):
        kids = {c.tag for c in case}
        if kids & {"failure", "error"}:
            failed += 1
        elif "skipped" in kids:
            msg = " ".join((c.get("type") or "") + (c.get("message") or "") for c in case if c.tag == "skipped")
            if "xfail" in msg:
                xfailed += 1
            else:
                skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped, "xfailed": xfailed}


def parse_backend_ops(text: str) -> dict:
    """tests/cpp/backend_ops.cpp's log: one "<case>: ok" line per case that passed, ALL OK at the end."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    ok = sum(ln.endswith(": ok") for ln in lines)
    bad = [ln for ln in lines if ": " in ln and not ln.endswith(": ok")]
    all_ok = bool(lines) and lines[-1].strip() == "ALL OK"
    return {"passed": ok, "failed": len(bad) if bad or all_ok else max(1, len(bad))}


def parse_sanitizer(text: str) -> dict:
    """Sums compute-sanitizer's summaries: memcheck's "ERROR SUMMARY: N errors", racecheck's
    "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".  runs = summaries seen."""
    errors = sum(int(m) for m in re.findall(r"ERROR SUMMARY:\s+(\d+) error", text))
    hazards = sum(int(m) for m in re.findall(r"RACECHECK SUMMARY:\s+(\d+) hazard", text))
    runs = len(re.findall(r"(?:ERROR|RACECHECK) SUMMARY:", text))
    return {"errors": errors, "hazards": hazards, "runs": runs}


def part_checks(junit: list[str], backend_ops: str | None, memcheck: list[str], racecheck: list[str]) -> dict:
    tests = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    notes = []
    for path in junit:
        if not Path(path).is_file():
            tests["failed"] += 1
            notes.append(f"{path}: missing (the test run did not finish)")
            continue
        for k, v in parse_junit(path).items():
            tests[k] += v
    if backend_ops:
        p = Path(backend_ops)
        ops = parse_backend_ops(p.read_text(errors="replace")) if p.is_file() else {"passed": 0, "failed": 1}
        tests["backend_ops_passed"], tests["backend_ops_failed"] = ops["passed"], ops["failed"]
        tests["passed"] += ops["passed"]
        tests["failed"] += ops["failed"]

    def sanitize(paths: list[str], key: str) -> int | None:
        if not paths:
            return None
        total = 0
        for path in paths:
            p = Path(path)
            s = parse_sanitizer(p.read_text(errors="replace")) if p.is_file() else {"runs": 0}
            if s["runs"] == 0:  # no summary: the run crashed or never started; count it as a finding
                notes.append(f"{path}: no sanitizer summary")
                total += 1
            else:
                total += s[key]
        return total

    sanitizer = {"memcheck_errors": sanitize(memcheck, "errors"), "racecheck_hazards": sanitize(racecheck, "hazards")}
    return {"tests": tests, "sanitizer": sanitizer, "notes": notes}


# ------------------------------------------------------------------------------------------- llamacpp
def parse_llama_bench(rows: list[dict]) -> dict:
    """llama-bench -o json rows -> decode / prefill tok/s (avg_ts of tg / pp rows) and the build."""
    out: dict = {"decode_tok_s": None, "prefill_512_tok_s": None, "prefill_8192_tok_s": None, "build": None}
    for r in rows:
        ts = float(r["avg_ts"])
        n_p, n_g = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        if n_g > 0 and n_p == 0:
            out["decode_tok_s"] = ts
            out["decode_tokens"] = n_g
        elif n_p > 0 and n_g == 0:
            out[f"prefill_{n_p}_tok_s"] = ts
        if r.get("build_commit"):
            out["build"] = f"{r['build_commit']} (build {r.get('build_number', '?')})"
        for k in ("gpu_info", "backends", "model_type", "flash_attn", "n_gpu_layers"):
            if k in r:
                out.setdefault(k, r[k])
    return out


def part_llamacpp(bench_bin: str | None, model: str | None, json_in: str | None, n_gen: int, prompts: str,
                  reps: int) -> dict:
    if json_in:
        text = Path(json_in).read_text()
    else:
        cmd = [bench_bin, "-m", model, "-ngl", "99", "-fa", "on", "-p", prompts, "-n", str(n_gen),
               "-r", str(reps), "-o", "json"]
        print("running:", " ".join(cmd), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"llama-bench failed ({run.returncode}): {run.stderr[-2000:]}")
        text = run.stdout
    out = parse_llama_bench(json.loads(text))
    out["file"] = str(model) if model else None
    return out


# ----------------------------------------------------------------------------------------------- ours
def tree_shape(n_nodes: int, kind: str) -> list[int]:
    """Parents (0 = the root) of n_nodes - 1 draft nodes: "chain", or "tree": a DDTree-like shape, a main
    path with one sibling at every depth (node depth ~ n/2), in topological order."""
    n = n_nodes - 1
    if kind == "chain":
        return list(range(n))
    parents, spine = [], 0
    for i in range(1, n + 1):
        if i % 2 == 1:  # odd ids extend the main path
            parents.append(spine)
            spine = i
        else:  # even ids are siblings of the node before them
            parents.append(parents[-1])
    return parents


def _gen(dec, ids, n, **kw):
    r = dec.generate(ids, n, ignore_eos=True, **kw)
    return r, r.stats


def _step_ms(st) -> list[float]:
    return [d + t + v + c for d, t, v, c in zip(st.draft_ms, st.tree_ms, st.verify_ms, st.commit_ms)]


def _cuda_memory(lib, ffi, reset: bool = False) -> dict | None:
    m = ffi.new("dfl_cuda_memory*")
    if lib.dfl_cuda_memory_stats(m, 1 if reset else 0) != 0:
        return None
    return {"allocated": int(m.allocated), "peak": int(m.peak), "device_free": int(m.device_free),
            "device_total": int(m.device_total)}


def cuda_op_profile(lib, ffi, run) -> dict[str, dict]:
    """Per-op GPU time of what run() does on CUDA contexts (dfl_cuda_profile): {op: {calls, ms, bytes}}."""
    from dflash27b._lib import check
    check(lib.dfl_cuda_profile(1))
    try:
        run()
    finally:
        check(lib.dfl_cuda_profile(0))
    need = ffi.new("int64_t*")
    lib.dfl_cuda_profile_report(ffi.NULL, 0, need)  # fails, saying the length
    buf = ffi.new("char[]", need[0] + 1)
    check(lib.dfl_cuda_profile_report(buf, need[0] + 1, need))
    return {r["op"]: {"calls": r["calls"], "ms": r["ms"], "bytes": r["bytes"]}
            for r in json.loads(ffi.string(buf).decode())["ops"]}


def step_profile(lib, ffi, gen, n_short: int, n_long: int) -> dict:
    """Each op's GPU time per decode step: the profile of a long decode minus a short one (the same prompt, so
    the prefill cancels), over the difference in steps.  gen(n) decodes n tokens and returns its stats."""
    runs = []
    for n in (n_short, n_long):
        box = {}
        prof = cuda_op_profile(lib, ffi, lambda n=n: box.update(st=gen(n)))
        runs.append((prof, box["st"].steps))
    (a, sa), (b, sb) = runs
    return profile_rows(b, sb - sa, minus=a)


def graph_comparison(lib, ffi, run) -> dict:
    """One decode timed with graph mode on (as configured; after a warm-up run, since a segment is captured
    the second time it is seen) and off (dfl_cuda_graph_mode): the median step of each, and the share of
    the decode's ops replayed from graphs when on."""
    stats = ffi.new("dfl_cuda_graphs*")
    out: dict = {}
    try:
        for mode, key in ((-1, "on"), (0, "off")):
            if lib.dfl_cuda_graph_mode(mode) != 0:
                return {"error": "dfl_cuda_graph_mode failed"}
            if key == "on":
                run()
            lib.dfl_cuda_graph_stats(stats, 1)
            steps = _step_ms(run())
            lib.dfl_cuda_graph_stats(stats, 1)
            out[f"step_ms_{key}"] = _median(steps)
            if key == "on":
                ops = stats.direct_ops + stats.replayed_ops
                out["replayed_share"] = stats.replayed_ops / ops if ops else None
                out["graph_launches"] = int(stats.graph_launches)
    finally:
        lib.dfl_cuda_graph_mode(-1)
    on, off = out.get("step_ms_on"), out.get("step_ms_off")
    out["speedup"] = off / on if on and off else None
    return out


def attention_grouping(lib, ffi, dec, ids: list[int], tree_ids, steps_tokens: int) -> dict:
    """An AR step and a 23-node tree verify after a long prompt, with attention's CTAs grouping a KV head's
    query heads and a block of tokens (auto: K/V read once per group) against one query row per CTA (the
    pinned (1, 1): K/V read once per head and token) and against the largest group a CTA takes (kv_group, the
    pinned (32, 32): never halved for more CTAs; auto halves it until the device has 2 CTAs an SM, which for an AR
    step at 8K is one row a CTA, while the tensor-core kernel computes 16 rows a CTA whatever it holds), and with
    the f32 kernel (dfl_cuda_attention_kernel(-1),
    DFLASH27B_CUDA_ATTN=simt) against the tensor-core one (attention_mma.cuh).  Each row's arithmetic is the
    same whatever the grouping, so auto's and one row's greedy tokens must agree; the f32 kernel rounds
    differently, so its tokens are only shown.  The times show what the grouping and the tensor cores save
    where attention is long."""
    parents = tree_shape(23, "tree")
    out: dict = {"prompt_tokens": len(ids)}
    toks = {}
    try:
        for name, (rows_tok, rows_head), kernel in (("auto", (0, 0), 0), ("one_row", (1, 1), 0),
                                                    ("kv_group", (32, 32), 0), ("simt", (0, 0), -1)):
            if lib.dfl_cuda_attention_rows(rows_tok, rows_head) != 0 or lib.dfl_cuda_attention_kernel(kernel) != 0:
                return {**out, "error": ffi.string(lib.dfl_last_error()).decode()}
            r, st = _gen(dec, ids, steps_tokens, mode="ar")
            toks[name] = r.tokens
            dec._ctx.set_tree_hook(lambda pos, tok, cap, _p=parents: (tree_ids(len(_p))[:cap], _p[:cap]))
            _, st2 = _gen(dec, ids, steps_tokens, mode="ddtree", budget=22)
            dec._ctx.set_tree_hook(None)
            out[name] = {"ar_ms": _median(st.verify_ms), "verify23_ms": _median(st2.verify_ms)}
    finally:
        dec._ctx.set_tree_hook(None)
        lib.dfl_cuda_attention_rows(0, 0)
        lib.dfl_cuda_attention_kernel(0)
    out["same_tokens"] = toks["auto"] == toks["one_row"] == toks["kv_group"]
    out["simt_same_tokens"] = toks["auto"] == toks["simt"]
    return out


def profile_rows(prof: dict[str, dict], steps: int, minus: dict[str, dict] | None = None) -> dict:
    """A cuda_op_profile (less `minus`) as rows per step, slowest first: ms, calls and GB/s of each op."""
    ops = []
    for op, r in prof.items():
        q = (minus or {}).get(op, {"calls": 0, "ms": 0.0, "bytes": 0.0})
        calls, ms, nbytes = r["calls"] - q["calls"], r["ms"] - q["ms"], r["bytes"] - q["bytes"]
        if calls <= 0 or steps <= 0:
            continue
        ops.append({"op": op, "ms_per_step": ms / steps, "calls_per_step": calls / steps,
                    "gb_s": nbytes / (ms * 1e-3) / 1e9 if nbytes > 0 and ms > 0 else None})
    ops.sort(key=lambda o: -o["ms_per_step"])
    return {"steps": steps, "ms_per_step": sum(o["ms_per_step"] for o in ops), "ops": ops}


def part_ours(target: str | None, draft: str | None, device: str, ctx: int, kv_type: str, threads: int,
              n_decode: int, prefills: list[int], nodes: list[int], repeats: int, steps_tokens: int,
              oracle_block: int, seed: int, checkpoint=None) -> dict:
    """checkpoint(out): called after each section with what is measured so far (marked partial), so a run
    cut short by the device's time limit still leaves its numbers."""
    from dflash27b import Decoder
    from dflash27b._lib import load
    from dflash27b.decoder import bundled_pair
    from dflash27b.tools.oracle_draft import attach_oracle

    if target is None:
        target, bundled_draft = bundled_pair()
        draft = draft or bundled_draft
    ffi, lib = load()
    cuda = device == "cuda"
    if cuda:
        _cuda_memory(lib, ffi, reset=True)
    out: dict = {"target": str(target), "draft": str(draft) if draft else None, "ctx": ctx, "kv_type": kv_type,
                 "repeats": repeats, "notes": []}

    def save() -> None:
        if checkpoint:
            checkpoint({**out, "partial": True})
    t_load = time.perf_counter()
    with Decoder(target, draft, device=device, ctx=ctx, kv_type=kv_type, threads=threads) as dec:
        out["load_s"] = time.perf_counter() - t_load
        out["device"] = dec.backend
        rng = np.random.default_rng(seed)
        n_vocab = dec.info["n_vocab"]
        # ids from the ordinary vocabulary (a synthetic file's high ids are padding, still valid tokens)
        rand_ids = lambda n: [int(x) for x in rng.integers(1000 % n_vocab, n_vocab, n)]  # noqa: E731
        prompt = dec.tokenize(PROMPTS[0]) + rand_ids(24)

        # AR decode: tok/s and one step
        ar_runs = []
        for _ in range(repeats):
            r, st = _gen(dec, prompt, n_decode, mode="ar")
            ar_runs.append((st.decode_tok_s, _median(st.verify_ms)))
        ar_tok_s = _median(x[0] for x in ar_runs)
        ar_ms = _median(x[1] for x in ar_runs)
        ar_tokens = r.tokens
        out["ar"] = {"decode_tok_s": ar_tok_s, "decode_tokens": n_decode}
        out["steps"] = {"ar_ms": ar_ms}
        if cuda:  # graph mode (the default) against each op launched on its own, and how much of a step replays
            out["graphs"] = {"ar": graph_comparison(lib, ffi, lambda: _gen(dec, prompt, 48, mode="ar")[1])}
        save()

        # prefill: one chunked forward over P prompt tokens (n_batch chunks, as generate does)
        for p in prefills:
            if p + 2 > ctx:
                out["notes"].append(f"prefill {p} skipped: context {ctx}")
                out["ar"][f"prefill_{p}_tok_s"] = None
                continue
            ids = rand_ids(p)
            tps = []
            for i in range(repeats):
                _, st = _gen(dec, ids, 1, mode="ar")
                tps.append(st.prefill_tok_s)
                if st.prefill_s > 20:  # a slow prefill is measured once: its noise is small
                    break
            out["ar"][f"prefill_{p}_tok_s"] = _median(tps)
            if cuda and p == max(prefills):  # where the longest prefill's time goes (one step: the whole prompt
                # and the first token's AR step, which is a small share of it)
                out.setdefault("profile", {})[f"prefill_{p}"] = profile_rows(
                    cuda_op_profile(lib, ffi, lambda ids=ids: _gen(dec, ids, 1, mode="ar")), 1)
        save()

        # verify by node count: a tree hook hands the generator fixed shapes (random tokens: nothing is
        # accepted, every step verifies exactly n nodes)
        verify: dict[str, dict[str, float | None]] = {"chain": {}, "tree": {}}
        for kind in ("chain", "tree"):
            for n in nodes:
                parents = tree_shape(n, kind)
                dec._ctx.set_tree_hook(lambda pos, tok, cap, _p=parents: (rand_ids(len(_p))[:cap], _p[:cap]))
                _, st = _gen(dec, prompt, steps_tokens, mode="ddtree", budget=n - 1)
                assert not st.tree_size or max(st.tree_size) == n - 1, (n, st.tree_size)
                verify[kind][str(n)] = _median(st.verify_ms)
        dec._ctx.set_tree_hook(None)
        out["steps"]["verify_ms"] = verify["chain"]
        out["steps"]["verify_tree_ms"] = verify["tree"]
        save()

        # the drafter's block step, tree build, a whole DDTree-22 step and commit (the drafter proposes)
        if dec.draft_info is not None:
            _, st = _gen(dec, prompt, steps_tokens, mode="ddtree", budget=22)
            out["steps"].update(draft_ms=_median(st.draft_ms), tree_ms=_median(st.tree_ms),
                                ddtree22_verify_ms=_median(st.verify_ms), commit_ms=_median(st.commit_ms),
                                ddtree22_step_ms=_median(_step_ms(st)), ddtree22_accept=st.mean_accept)
            if cuda:
                out["graphs"]["ddtree22"] = graph_comparison(
                    lib, ffi, lambda: _gen(dec, prompt, steps_tokens, mode="ddtree", budget=22)[1])
        else:
            out["notes"].append("no drafter: draft / DDTree-22 step not measured")
        save()

        # where a step's GPU time goes, op by op: AR and DDTree-22 (events around each op; their sum is a
        # little above the step's GPU time, launch gaps and host time are not in it)
        if cuda:
            out.setdefault("profile", {})["ar"] = step_profile(
                lib, ffi, lambda n: _gen(dec, prompt, n, mode="ar")[1], steps_tokens // 2, steps_tokens)
            if dec.draft_info is not None:
                out["profile"]["ddtree22"] = step_profile(
                    lib, ffi, lambda n: _gen(dec, prompt, n, mode="ddtree", budget=22)[1], steps_tokens // 2,
                    steps_tokens)
        save()

        # the oracle drafter (the target's own continuation ranked first): accept length ~ the block
        attach_oracle(dec, prompt, ar_tokens)
        o_runs = []
        for _ in range(repeats):
            r, st = _gen(dec, prompt, len(ar_tokens), mode="ddtree", budget=22, block_size=oracle_block)
            o_runs.append((st.decode_tok_s, st.mean_accept, r.tokens == ar_tokens))
        # auto mode on the same oracle: it must find the speculative budget that pays (its estimates carry
        # over from this decoder's earlier runs, as in a long-running daemon)
        a_runs = []
        for _ in range(repeats):
            r, st = _gen(dec, prompt, len(ar_tokens), mode="auto", budget=22, block_size=oracle_block)
            a_runs.append((st.decode_tok_s, r.tokens == ar_tokens, st.auto_summary))
        dec._ctx.set_topk_hook(None)
        o_tok_s = _median(x[0] for x in o_runs)
        a_tok_s = _median(x[0] for x in a_runs)
        out["oracle"] = {"accept_length": _median(x[1] for x in o_runs), "tok_s": o_tok_s,
                         "speedup": o_tok_s / ar_tok_s if o_tok_s and ar_tok_s else None,
                         "block_size": oracle_block, "eq_ar": all(x[2] for x in o_runs),
                         "auto_tok_s": a_tok_s, "auto_eq_ar": all(x[1] for x in a_runs),
                         "auto_choices": a_runs[-1][2]}

        plan = dict(dec.memory_plan)
        out["memory"] = {"plan_bytes": int(plan["total"]), "plan": plan, "peak_bytes": None}
        if cuda:
            mem = _cuda_memory(lib, ffi)
            if mem:
                out["memory"].update(peak_bytes=mem["peak"], device_used_bytes=mem["device_total"] - mem["device_free"],
                                     device_total_bytes=mem["device_total"])
        save()

        # attention's query-row grouping at long context (CUDA; last: four long prefills): grouped against
        # one row per CTA
        if cuda:
            long_prompt = min(8000, ctx - steps_tokens - 64)
            out["attention"] = attention_grouping(lib, ffi, dec, rand_ids(long_prompt), rand_ids, steps_tokens)
    if cuda:
        gbs = lib.dfl_cuda_bench_copy(1 << 30, 20)
        out["copy_gb_s"] = float(gbs) if gbs > 0 else None
    else:
        out["copy_gb_s"] = None
        out["read_gb_s"] = float(lib.dfl_measure_read_bandwidth(1 << 28, threads))
    return out


# --------------------------------------------------------------------------------------------- vram24
def part_vram24(target: str, draft: str, cap_gib: float, ctx: int, prompt_len: int, n_new: int, kv_type: str,
                draft_type: str | None, threads: int) -> dict:
    """The 24 GB card on a bigger GPU: a ballast allocation leaves exactly cap_gib free, then the target + drafter
    at ctx with DDTree-22 after a prompt_len-token prompt; DDTree == AR on that run, peak vs plan vs cap."""
    import torch

    from dflash27b import Decoder
    from dflash27b._lib import load
    ffi, lib = load()
    cap = int(cap_gib * 2**30)
    free, _ = torch.cuda.mem_get_info()
    if free < cap:
        return {"notes": [f"vram24: only {free / 2**30:.1f} GiB free, cannot cap at {cap_gib} GiB"]}
    ballast = torch.empty(free - cap, dtype=torch.uint8, device="cuda")
    _cuda_memory(lib, ffi, reset=True)
    out: dict = {"ctx": ctx, "cap_bytes": cap, "kv_type": kv_type, "draft_type": draft_type or "stored",
                 "prompt_tokens": prompt_len, "notes": []}
    try:
        with Decoder(target, draft, device="cuda", ctx=ctx, kv_type=kv_type, threads=threads,
                     draft_type=draft_type) as dec:
            out["plan_bytes"] = int(dec.memory_plan["total"])
            rng = np.random.default_rng(1)
            ids = [int(x) for x in rng.integers(1000, dec.info["n_vocab"], prompt_len)]
            ar = dec.generate(ids, n_new, ignore_eos=True, mode="ar")
            dd = dec.generate(ids, n_new, ignore_eos=True, mode="ddtree", budget=22)
            out["exact"] = dd.tokens == ar.tokens
            out["prefill_tok_s"] = ar.stats.prefill_tok_s
            out["ar_tok_s"], out["ddtree_tok_s"] = ar.stats.decode_tok_s, dd.stats.decode_tok_s
            mem = _cuda_memory(lib, ffi)
            out["peak_bytes"] = mem["peak"] if mem else None
    except Exception as exc:  # a refusal (plan too big) is a result too
        out["error"] = str(exc)
    finally:
        del ballast
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------- prefix
def part_prefix(target: str | None, draft: str | None, device: str, history: int, n_new: int, ctx: int,
                threads: int, seed: int) -> dict:
    """The prefix cache on the device: turn 1 = a `history`-token prompt, turn 2 = turn 1 + its reply + 24 new
    tokens; time to the first token of each (in-process, the cache on), each reply against a cold decode."""
    from dflash27b import Decoder
    from dflash27b.decoder import bundled_pair

    if target is None:
        target, draft = bundled_pair()
    out: dict = {"history": history, "notes": []}
    with Decoder(target, draft, device=device, ctx=ctx, threads=threads, cache_mem=8 << 30) as dec:
        rng = np.random.default_rng(seed)
        ids = [int(x) for x in rng.integers(1000 % dec.info["n_vocab"], dec.info["n_vocab"], history + 24)]

        def ttft(prompt, cache=True):
            t0 = time.perf_counter()
            first, toks = None, []
            for step in dec.stream_ids(prompt, n_new, ignore_eos=True, cache=cache):
                if first is None:
                    first = time.perf_counter() - t0
                toks += step
            return first, toks, dec.last_stats()

        t1, r1, _ = ttft(ids[:history])
        turn2 = ids[:history] + r1 + ids[history:]
        t2, r2, s2 = ttft(turn2)
        _, cold2, _ = ttft(turn2, cache=False)
        out.update(turn1_ttft_s=t1, turn2_ttft_s=t2, ratio=t2 / t1 if t1 else None, cached_tokens=s2.cached_tokens,
                   exact=r2 == cold2)
    return out


# ---------------------------------------------------------------------------------------- draft model
def part_draftmodel(target: str | None, draft: str | None, device: str, n_new: int, threads: int,
                    blocks: list[int]) -> dict:
    """Classic draft-model speculation (a 0.8B-shaped qwen35 drafting for the 27B): per block size, the draft
    step (the draft model's forwards), the verify, the whole step, in AR steps; accept length; == AR.  DDTree
    both from one draft pass and by expanding branches (4 per depth): what the wider draft forwards cost on
    the GPU (bench/draft_tree.py measured their acceptance: +0-4% on the CPU pairs)."""
    from dflash27b import Decoder

    if target is None:  # the CPU check: the tests' recipe, a tiny F32 target and its Q4_K_M copy
        import tempfile
        from dflash27b.tools.synth import write_synthetic
        tmp = tempfile.mkdtemp()
        target = str(write_synthetic(f"{tmp}/t.gguf", "tiny", "f32", seed=0))
        draft = str(write_synthetic(f"{tmp}/d.gguf", "tiny", "q4_k_m", seed=0))
    out: dict = {"target": target, "draft": draft, "blocks": {}, "notes": []}
    with Decoder(target, draft, device=device, ctx=2048, threads=threads) as dec:
        ids = dec.tokenize(PROMPTS[0])
        ar = dec.generate(ids, n_new, ignore_eos=True, mode="ar")
        ar_ms = _median(ar.stats.verify_ms)
        out["ar_ms"] = ar_ms
        for b in blocks:
            for mode, expand in (("chain", 0), ("ddtree", 0), ("ddtree", 4)):
                r = dec.generate(ids, n_new, ignore_eos=True, mode=mode, block_size=b, expand=expand)
                st = r.stats
                step = _median(_step_ms(st))
                out["blocks"][f"{mode}-{b}" + (f"-expand{expand}" if expand else "")] = {
                    "accept_length": st.mean_accept, "draft_ms": _median(st.draft_ms), "verify_ms": _median(st.verify_ms),
                    "step_ms": step, "step_in_ar": step / ar_ms if step and ar_ms else None,
                    "speedup": st.decode_tok_s / ar.stats.decode_tok_s if ar.stats.decode_tok_s else None,
                    "eq_ar": r.tokens == ar.tokens}
    return out


def part_drafters(target: str | None, draft: str | None, device: str, n_new: int, threads: int, ctx: int) -> dict:
    """The drafters beside DFlash on the 27B with an MTP head (issue 43's table): the model's own head, prompt
    lookup and the portfolio of all three, in one decoder (the head first: chain and DDTree draft with it).
    Per drafter, auto mode's measured costs after the warm-up and the decodes: the draft in AR steps and the
    verify by node count; the head's chain and DDTree steps (step, draft, verify in AR steps, accept length,
    == AR); auto over the portfolio (tok/s vs AR, its AR steps' cost against a plain AR step: what carrying
    the drafters costs, == AR).  Random weights accept next to nothing, so the costs are the record here,
    not the acceptance."""
    from dflash27b import Decoder

    if target is None:  # the CPU check: a tiny target with an MTP head and a drafter of its shape
        import tempfile
        from dflash27b.tools.synth import write_synthetic, write_synthetic_draft
        tmp = tempfile.mkdtemp()
        target = str(write_synthetic(f"{tmp}/t.gguf", "tiny", "f32", seed=0, mtp=True))
        draft = str(write_synthetic_draft(f"{tmp}/d", "tiny", seed=0))
    out: dict = {"target": target, "draft": draft, "n_new": n_new, "notes": []}
    with Decoder(target, ["mtp", draft, "lookup"], device=device, ctx=ctx, threads=threads) as dec:
        ids = dec.tokenize(PROMPTS[0])
        ar = dec.generate(ids, n_new, ignore_eos=True, mode="ar", cache=False)
        ar_ms = _median(ar.stats.verify_ms)
        out["ar_ms"], out["ar_tok_s"] = ar_ms, ar.stats.decode_tok_s
        in_ar = lambda ms: ms / ar_ms if ms is not None and ar_ms else None  # noqa: E731
        for mode in ("chain", "ddtree"):  # the head's own steps
            r = dec.generate(ids, n_new, ignore_eos=True, mode=mode, cache=False)
            st = r.stats
            out[f"mtp_{mode}"] = {"accept_length": st.mean_accept, "step_in_ar": in_ar(_median(_step_ms(st))),
                                  "draft_in_ar": in_ar(_median(st.draft_ms)), "verify_in_ar": in_ar(_median(st.verify_ms)),
                                  "tok_s": st.decode_tok_s, "eq_ar": r.tokens == ar.tokens}
        auto = dec.generate(ids, n_new, ignore_eos=True, mode="auto", cache=False)
        st = auto.stats
        ar_steps = [v for v, b in zip(st.verify_ms, st.auto_budget) if b == 0]
        out["auto"] = {"tok_s": st.decode_tok_s, "vs_ar": st.decode_tok_s / ar.stats.decode_tok_s
                       if ar.stats.decode_tok_s else None, "accept_length": st.mean_accept,
                       "ar_step_in_ar": in_ar(_median(ar_steps)) if ar_steps else None,
                       "trees_by_drafter": {d: st.drafter.count(d) for d in sorted({d for d in st.drafter if d})},
                       "eq_ar": auto.tokens == ar.tokens}
        ctx_ = dec._ctx
        out["estimates"] = {}
        for k, name in enumerate(ctx_.drafter_names()):
            e = ctx_.auto_estimates(k)
            a = e["ar_s"]
            out["estimates"][name] = {"ar_ms": a * 1e3, "draft_in_ar": e["draft_s"] / a if a else None,
                                      "verify_in_ar": {n: v / a for n, v in e["verify_s"].items()} if a else None,
                                      # the draft by block rows (a request's last steps draft shorter blocks)
                                      "draft_rows_in_ar": {n: v / a for n, v in e["draft_rows_s"].items()}
                                      if a else None}
    return out


def part_slots(target: str | None, draft: str | None, device: str, n_new: int, threads: int, slots: int,
               ctx: int) -> dict:
    """N requests decoded at once (slots sharing the backend, one batched forward a step) against one stream:
    aggregate decode tok/s (tokens after the first over the shared decode time), AR and auto, == solo."""
    from dflash27b import Decoder

    out: dict = {"target": target, "draft": draft, "slots": slots, "n_new": n_new, "notes": []}
    with Decoder(target, draft, device=device, ctx=ctx, threads=threads, slots=slots) as dec:
        prompts = [dec.tokenize(PROMPTS[k % len(PROMPTS)] + "#" * k) for k in range(slots)]
        solo = [dec.generate(p, n_new, ignore_eos=True, mode="ar", cache=False) for p in prompts]
        one = statistics.median(r.stats.decode_tok_s for r in solo)

        def aggregate(rs) -> float:
            secs = max(r.stats.decode_s for r in rs)
            return sum(r.stats.generated_tokens - 1 for r in rs) / secs if secs > 0 else 0.0
        many = dec.generate_many(prompts, n_new, ignore_eos=True, mode="ar", cache=False)
        many = dec.generate_many(prompts, n_new, ignore_eos=True, mode="ar", cache=False)  # (warm)
        rows = {"one_stream_tok_s": one, "ar_tok_s": aggregate(many),
                "ar_eq_solo": [r.tokens for r in many] == [r.tokens for r in solo]}
        if dec._has_drafter():   # (the CPU check's bundled pair too)
            auto = dec.generate_many(prompts, n_new, ignore_eos=True, mode="auto", cache=False)
            rows.update(auto_tok_s=aggregate(auto), auto_eq_solo=[r.tokens for r in auto] == [r.tokens for r in solo])
            # DDTree in every slot: the drafters' blocks in one drafter forward a step, against one stream's
            tree = dict(ignore_eos=True, mode="ddtree", budget=8, cache=False)
            one_tree = dec.generate(prompts[0], n_new, **tree)
            many_tree = dec.generate_many(prompts, n_new, **tree)
            rows.update(ddtree_one_tok_s=one_tree.stats.decode_tok_s, ddtree_tok_s=aggregate(many_tree),
                        ddtree_draft_ms=_median([ms for r in many_tree for ms in r.stats.draft_ms]),
                        ddtree_one_draft_ms=_median(one_tree.stats.draft_ms),
                        ddtree_eq_solo=[r.tokens for r in many_tree] ==
                        [dec.generate(p, n_new, **tree).tokens for p in prompts])
        rows["ar_vs_one"] = rows["ar_tok_s"] / one if one else None
        out.update(rows)
    return out


# --------------------------------------------------------------------------------------------- matmul
# ggml type id, elements per block, bytes per block
MATMUL_FORMATS = {"Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210), "Q8_0": (8, 32, 34),
                  "Q4_0": (2, 32, 18), "F16": (1, 1, 2), "BF16": (30, 1, 2)}
MATMUL_SHAPES = {"ffn_up 17408x5120": (17408, 5120), "ffn_down 5120x17408": (5120, 17408)}


# the forward's matmul takes the batch-invariant ("exact") kernels for these (F16 / BF16: tf32 tensor cores)
EXACT_FORMATS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "F16", "BF16")


def part_matmul(ns: list[int], formats: list[str]) -> dict:
    """The CUDA matmul alone on random device-resident weights: ms per call and GB/s of weights read, for
    the 27B's FFN shapes, every format, n tokens (dfl_cuda_bench_matmul, CUDA events).  A format's row is
    the exact kernels the forward uses (activation quantisation included); "<fmt> float" beside it is the
    float kernels, for comparison."""
    from dflash27b._lib import last_error, load
    ffi, lib = load()
    out: dict = {"shapes": {}, "notes": []}
    for shape, (rows, cols) in MATMUL_SHAPES.items():
        table: dict = {}
        for name in formats:
            tid, be, bpb = MATMUL_FORMATS[name]
            gb = rows * (cols // be) * bpb / 1e9
            for label, exact in ((name, 1), (f"{name} float", 0)) if name in EXACT_FORMATS else ((name, 0),):
                table[label] = {}
                for n in ns:
                    ms = lib.dfl_cuda_bench_matmul(tid, rows, cols, n, 200 if n <= 8 else (50 if n <= 64 else 10),
                                                   exact)
                    if ms < 0:
                        out["notes"].append(f"matmul: {last_error()}")
                        return out
                    table[label][str(n)] = {"ms": ms, "gb_s": gb / (ms * 1e-3)}
        out["shapes"][shape] = table
    return out


# --------------------------------------------------------------------------------------------- matvec
# The 27B's AR-step matmuls (format, rows x cols), from the first H100 record's op profile
# (bench/results/gpu-20261127-0552.md): the FFN, the attention and delta-net projections, the 48-row
# per-head projections of a delta-net layer.
MATVEC_SHAPES = [("Q4_K", 17408, 5120), ("Q6_K", 5120, 17408), ("Q4_K", 5120, 17408), ("Q4_K", 5120, 6144),
                 ("Q4_K", 6144, 5120), ("Q6_K", 10240, 5120), ("Q4_K", 10240, 5120), ("Q4_K", 12288, 5120),
                 ("Q4_K", 1024, 5120), ("Q4_K", 48, 5120)]
MATVEC_ROWS = (0, 16, 8, 4, 2, 1)  # rows per CTA (dfl_cuda_matvec_rows); 0 = the automatic choice
MATVEC_FEW_ROWS = 2048  # weights with fewer rows verify on the matvec, 8 tokens a pass (matmul_exact.cu)
# verifies and prefill chunks on the tensor cores (dfl_cuda_mma_split): the streaming kernel with 1, 2 or 4 warps
# splitting a row group's K, the automatic choice, the round-synchronous kernel the first record timed, and the
# tiled kernel (shared-memory tiles of 128 rows x 64 tokens) that takes prefill chunks by default
VERIFY_NS = (16, 23, 64, 512)  # 512: a prefill chunk
MMA_SPLITS = ((0, "auto"), (1, "w1"), (2, "w2"), (4, "w4"), (-1, "sync"), (-2, "tiled"))


class _BenchFailed(Exception):
    pass


def _timed_by_pin(lib, last_error, what: str, set_pin, pins, tid: int, rows: int, cols: int, n: int, iters: int,
                  gb: float) -> dict:
    """One table row: the exact matmul of n tokens timed with each (pin, key) set by set_pin, GB/s of weights
    read, and `best`, the fastest pinned choice (auto, pin 0, is never `best`: it is one of the others)."""
    row: dict = {}
    for pin, key in pins:
        if set_pin(pin) != 0:
            raise _BenchFailed(f"{what}: {last_error()}")
        ms = lib.dfl_cuda_bench_matmul(tid, rows, cols, n, iters, 1)
        if ms < 0:
            raise _BenchFailed(f"{what}: {last_error()}")
        row[key] = {"ms": ms, "gb_s": gb / (ms * 1e-3)}
    pinned = [k for k in row if k != "auto"]
    row["best"] = min(pinned, key=lambda k: row[k]["ms"])
    return row


def part_matvec(ns: list[int], checkpoint=None) -> dict:
    """The K-quant matvec (n <= 8 tokens) on each AR-step shape with every CTA shape dfl_cuda_matvec_rows can
    pin (16 rows: a lane group walks a row; fewer: the CTA's groups split the row's super-blocks), and the
    automatic choice: GB/s of weights read.  Then `verify`: the tensor-core kernels on the shapes of 2048 rows
    or more for verifies of VERIFY_NS tokens, by dfl_cuda_mma_split (the streaming kernel with 1, 2 or 4 warps
    a row group, auto, the round-synchronous kernel and the tiled one).  Every choice gives the same bits
    (tests/test_cuda_ops.py), so the fastest is the one to keep; `best` names it per shape and n.
    checkpoint(out): called after each shape with what is measured so far (marked partial), so a run cut
    short by its time limit still leaves its numbers."""
    from dflash27b._lib import last_error, load
    ffi, lib = load()
    out: dict = {"shapes": {}, "verify": {}, "notes": []}
    rows_pins = [(p, "auto" if p == 0 else str(p)) for p in MATVEC_ROWS]
    try:
        for fmt, rows, cols in MATVEC_SHAPES:
            tid, be, bpb = MATMUL_FORMATS[fmt]
            gb = rows * (cols // be) * bpb / 1e9
            table = {str(n): _timed_by_pin(lib, last_error, "matvec", lib.dfl_cuda_matvec_rows, rows_pins, tid, rows,
                                           cols, n, 200, gb) for n in ns}
            if rows < MATVEC_FEW_ROWS:  # a 23-node verify: the matvec 8 tokens a pass (auto) vs the tensor cores
                table["23"] = _timed_by_pin(lib, last_error, "matvec", lib.dfl_cuda_matvec_rows,
                                            ((0, "auto"), (-1, "mma")), tid, rows, cols, 23, 200, gb)
                table["23"]["best"] = min(("auto", "mma"), key=lambda k: table["23"][k]["ms"])
            lib.dfl_cuda_matvec_rows(0)
            out["shapes"][f"{fmt} {rows}x{cols}"] = table
            if checkpoint:
                checkpoint({**out, "partial": True})
        # verifies of 9..64 tokens on the tensor cores: the streaming kernel by K split, vs the round-synchronous one
        for fmt, rows, cols in MATVEC_SHAPES:
            if rows < MATVEC_FEW_ROWS:
                continue
            tid, be, bpb = MATMUL_FORMATS[fmt]
            gb = rows * (cols // be) * bpb / 1e9
            out["verify"][f"{fmt} {rows}x{cols}"] = {
                str(n): _timed_by_pin(lib, last_error, "verify", lib.dfl_cuda_mma_split, MMA_SPLITS, tid, rows, cols,
                                      n, 100 if n <= 64 else 20, gb) for n in VERIFY_NS}
            if checkpoint:
                checkpoint({**out, "partial": True})
    except _BenchFailed as e:
        out["notes"].append(str(e))
    finally:
        lib.dfl_cuda_matvec_rows(0)
        lib.dfl_cuda_mma_split(0)
    return out


# --------------------------------------------------------------------------------------------- record
def _get(d: dict | None, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def assemble(parts: dict[str, dict], commit: str | None, device: str | None, date: _dt.datetime) -> dict:
    """The record from the parts (each may be missing: its keys are null)."""
    ex, ck, lc, ours, mm, v24, v262, pf, dm, sl, dr, mv = (parts.get(k) or {} for k in (
        "exact", "checks", "llamacpp", "ours", "matmul", "vram24", "vram24_262k", "prefix", "draftmodel", "slots",
        "drafters", "matvec"))

    def capped(v: dict) -> dict | None:
        return {k: v.get(k) for k in ("ctx", "draft_type", "peak_bytes", "plan_bytes", "cap_bytes", "exact")} if v \
            else None

    exact_keys = ("cuda_ar_eq_cpu_ar", "chain_eq_ar", "ddtree_eq_ar", "sampled_ddtree_eq_ar")
    steps = dict.fromkeys(("ar_ms", "verify_ms", "verify_tree_ms", "draft_ms", "tree_ms", "ddtree22_step_ms",
                           "commit_ms"))
    steps.update(ours.get("steps") or {})
    rec = {
        "device": device or ours.get("device") or ex.get("device"),
        "commit": commit,
        "date": date.strftime("%Y-%m-%d %H:%M UTC"),
        "tests": {"passed": _get(ck, "tests", "passed"), "failed": _get(ck, "tests", "failed"),
                  **{k: v for k, v in (ck.get("tests") or {}).items() if k not in ("passed", "failed")}},
        "sanitizer": {"memcheck_errors": _get(ck, "sanitizer", "memcheck_errors"),
                      "racecheck_hazards": _get(ck, "sanitizer", "racecheck_hazards")},
        "exact": {k: ex.get(k) for k in exact_keys},
        "ar": {k: _get(ours, "ar", k) for k in ("decode_tok_s", "prefill_512_tok_s", "prefill_8192_tok_s")},
        "llamacpp": {k: lc.get(k) for k in ("decode_tok_s", "prefill_512_tok_s", "prefill_8192_tok_s", "build")},
        "steps": steps,
        "oracle": {k: _get(ours, "oracle", k) for k in ("accept_length", "tok_s", "speedup", "eq_ar", "auto_tok_s",
                                                          "auto_eq_ar", "auto_choices")},
        "memory": {"plan_bytes": _get(ours, "memory", "plan_bytes"), "peak_bytes": _get(ours, "memory", "peak_bytes"),
                   "plan": _get(ours, "memory", "plan")},
        "copy_gb_s": ours.get("copy_gb_s"),
        "target": ours.get("target"),
        "draft": ours.get("draft"),
        "matmul": mm.get("shapes"),
        "matvec": mv.get("shapes"),
        "mma_verify": mv.get("verify"),
        "vram24": capped(v24),
        "vram24_262k": capped(v262),
        "prefix": {k: pf.get(k) for k in ("history", "turn1_ttft_s", "turn2_ttft_s", "ratio", "cached_tokens",
                                          "exact")} if pf else None,
        "draft_model": {"ar_ms": dm.get("ar_ms"), "blocks": dm.get("blocks")} if dm else None,
        "slots": {k: sl.get(k) for k in ("slots", "one_stream_tok_s", "ar_tok_s", "ar_vs_one", "ar_eq_solo",
                                         "auto_tok_s", "auto_eq_solo", "ddtree_one_tok_s", "ddtree_tok_s",
                                         "ddtree_one_draft_ms", "ddtree_draft_ms", "ddtree_eq_solo")} if sl else None,
        "drafters": {k: dr.get(k) for k in ("target", "ar_ms", "ar_tok_s", "mtp_chain", "mtp_ddtree", "auto",
                                            "estimates")} if dr else None,
        "profile": ours.get("profile"),
        "graphs": ours.get("graphs"),
        "attention": ours.get("attention"),
        "notes": [n for p in (ex, ck, lc, ours, mm, v24, v262, pf, dm, sl, dr, mv) for n in (p.get("notes") or [])] +
                 [f"{name}: {v['error']}" for name, v in (("vram24", v24), ("vram24_262k", v262)) if v.get("error")] +
                 # a kernel set aside by the environment (DFLASH27B_CUDA_MMA=sync, ...) shows in the record
                 [f"run with {k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("DFLASH27B_CUDA_")],
    }
    weights = _get(ours, "memory", "plan", "weights")
    if weights and rec["copy_gb_s"]:
        # the AR step's floor: every weight byte read once at the copy rate (HBM reads at about the rate a
        # copy moves bytes read + written)
        rec["steps"]["ar_floor_ms"] = weights / (rec["copy_gb_s"] * 1e9) * 1e3
    if ex.get("near_ties"):
        rec["exact"]["near_ties"] = ex["near_ties"]
    if "graphs_off_eq_on" in ex:
        rec["exact"]["graphs_off_eq_on"] = ex["graphs_off_eq_on"]
    if ours.get("partial"):
        rec["notes"].append("ours: cut short (the numbers measured before the time limit; null after)")
    missing = [k for k in ("exact", "checks", "llamacpp", "ours") if k not in parts]
    if missing:
        rec["notes"].append("parts not measured in this run: " + ", ".join(missing))
    return rec


def _f(x, fmt: str = ".1f", none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def markdown(rec: dict) -> str:
    """The table the closing note quotes: ours vs llama.cpp, each step in AR steps, memory peak vs plan."""
    ar, lc, st = rec["ar"], rec["llamacpp"], rec["steps"]
    ar_ms = st.get("ar_ms")
    in_ar = lambda ms: None if ms is None or not ar_ms else ms / ar_ms  # noqa: E731
    ratio = lambda a, b: None if a is None or not b else a / b  # noqa: E731
    lines = [f"# GPU record {rec['date']} — {rec['device']} — commit {rec['commit'] or '?'}", ""]
    lines += [f"target `{rec['target']}`, drafter `{rec['draft']}`", ""]
    lines += ["| | ours tok/s | llama.cpp tok/s | ours / llama.cpp |", "|---|---:|---:|---:|"]
    for name, key in (("decode", "decode_tok_s"), ("prefill 512", "prefill_512_tok_s"),
                      ("prefill 8192", "prefill_8192_tok_s")):
        lines.append(f"| {name} | {_f(ar.get(key))} | {_f(lc.get(key))} | {_f(ratio(ar.get(key), lc.get(key)), '.2f')} |")
    lines += ["", f"llama.cpp build: {lc.get('build') or '—'}", ""]
    lines += ["| step | ms | AR steps |", "|---|---:|---:|", f"| AR step | {_f(ar_ms, '.3f')} | 1.00 |"]
    if st.get("ar_floor_ms"):
        lines.append(f"| AR floor (weights / copy rate) | {_f(st['ar_floor_ms'], '.3f')} | {_f(in_ar(st['ar_floor_ms']), '.2f')} |")
    for kind, key in (("chain", "verify_ms"), ("tree", "verify_tree_ms")):
        for n, ms in (st.get(key) or {}).items():
            lines.append(f"| verify {n} nodes ({kind}) | {_f(ms, '.3f')} | {_f(in_ar(ms), '.2f')} |")
    for name, key in (("drafter block", "draft_ms"), ("tree build", "tree_ms"), ("commit", "commit_ms"),
                      ("DDTree-22 step", "ddtree22_step_ms")):
        lines.append(f"| {name} | {_f(st.get(key), '.3f')} | {_f(in_ar(st.get(key)), '.2f')} |")
    for name, g in (rec.get("graphs") or {}).items():
        if isinstance(g, dict) and "step_ms_on" in g:
            lines.append(f"| {name} step, graph mode off / on | {_f(g.get('step_ms_off'), '.3f')} / "
                         f"{_f(g.get('step_ms_on'), '.3f')} | {_f(g.get('speedup'), '.2f')}x, "
                         f"{_f(100 * g['replayed_share'] if g.get('replayed_share') is not None else None, '.0f')}% "
                         "of ops replayed |")
    att = rec.get("attention") or {}
    for other, what, same in (("one_row", "attention grouped / one row a CTA", "same_tokens"),
                              ("kv_group", "attention grouped / a whole KV group a CTA", "same_tokens"),
                              ("simt", "attention on tensor cores / f32", "simt_same_tokens")):
        if "auto" not in att or other not in att:
            continue
        for key, label in (("ar_ms", "AR step"), ("verify23_ms", "verify 23 nodes (tree)")):
            a, b = att["auto"].get(key), att[other].get(key)
            lines.append(f"| {label} after {att.get('prompt_tokens')} tokens, {what} | {_f(a, '.3f')} / "
                         f"{_f(b, '.3f')} | {_f(b / a if a and b else None, '.2f')}x (same tokens: {att.get(same)}) |")
    o, m = rec["oracle"], rec["memory"]
    gib = lambda b: None if b is None else b / 2**30  # noqa: E731
    lines += ["", f"oracle drafter: accept length {_f(o.get('accept_length'), '.2f')}, {_f(o.get('tok_s'))} tok/s, "
                  f"{_f(o.get('speedup'), '.2f')}x AR (== AR: {o.get('eq_ar')}); auto on it {_f(o.get('auto_tok_s'))} "
                  f"tok/s (== AR: {o.get('auto_eq_ar')}; {o.get('auto_choices') or '—'})", ""]
    lines += [f"memory: peak {_f(gib(m.get('peak_bytes')), '.2f')} GiB vs plan {_f(gib(m.get('plan_bytes')), '.2f')} GiB"
              f"; device copy {_f(rec.get('copy_gb_s'), '.0f')} GB/s (read + write)", ""]
    t, s, e = rec["tests"], rec["sanitizer"], rec["exact"]
    lines += [f"tests: {t.get('passed')} passed, {t.get('failed')} failed; memcheck errors {s.get('memcheck_errors')}, "
              f"racecheck hazards {s.get('racecheck_hazards')}",
              "exact: " + ", ".join(f"{k} {e.get(k)}" for k in ("cuda_ar_eq_cpu_ar", "chain_eq_ar", "ddtree_eq_ar",
                                                                  "sampled_ddtree_eq_ar", "graphs_off_eq_on")
                                    if k in e)]
    for key in ("vram24", "vram24_262k"):
        v = rec.get(key)
        if v:
            lines += ["", f"24 GiB cap: ctx {v.get('ctx')}, drafter {v.get('draft_type') or 'stored'}, peak "
                          f"{_f(gib(v.get('peak_bytes')), '.2f')} GiB, plan {_f(gib(v.get('plan_bytes')), '.2f')} GiB, "
                          f"cap {_f(gib(v.get('cap_bytes')), '.2f')} GiB, DDTree == AR: {v.get('exact')}"]
    pf = rec.get("prefix")
    if pf:
        lines += ["", f"prefix cache, {pf.get('history')}-token history: turn 1 first token "
                      f"{_f(pf.get('turn1_ttft_s'), '.3f')} s, turn 2 {_f(pf.get('turn2_ttft_s'), '.3f')} s "
                      f"({_f(pf.get('ratio'), '.2f')}x, {pf.get('cached_tokens')} tokens reused), == cold: {pf.get('exact')}"]
    dm = rec.get("draft_model")
    if dm and dm.get("blocks"):
        lines += ["", "| draft model (0.8B shape) | accept | draft ms | verify ms | step (AR steps) | speedup | == AR |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for k, v in dm["blocks"].items():
            lines.append(f"| {k} | {_f(v['accept_length'], '.2f')} | {_f(v['draft_ms'], '.2f')} | "
                         f"{_f(v['verify_ms'], '.2f')} | {_f(v['step_in_ar'], '.2f')} | {_f(v['speedup'], '.2f')} | "
                         f"{v['eq_ar']} |")
    sl = rec.get("slots")
    if sl:
        lines += ["", f"{sl.get('slots')} requests at once: AR {_f(sl.get('ar_tok_s'))} tok/s in all vs one stream "
                      f"{_f(sl.get('one_stream_tok_s'))} ({_f(sl.get('ar_vs_one'), '.2f')}x), auto "
                      f"{_f(sl.get('auto_tok_s'))}; == solo: AR {sl.get('ar_eq_solo')}, auto {sl.get('auto_eq_solo')}",
                  f"DDTree-8 in every slot: {_f(sl.get('ddtree_tok_s'))} tok/s in all vs one stream "
                  f"{_f(sl.get('ddtree_one_tok_s'))}; the drafter step {_f(sl.get('ddtree_draft_ms'), '.2f')} ms for all "
                  f"slots' blocks at once vs {_f(sl.get('ddtree_one_draft_ms'), '.2f')} ms for one; == solo "
                  f"{sl.get('ddtree_eq_solo')}"]
    dr = rec.get("drafters")
    if dr:
        lines += ["", f"drafters on `{dr.get('target')}` (AR step {_f(dr.get('ar_ms'), '.2f')} ms): costs in AR steps",
                  "", "| | draft | verify 2 / 8 / 23 nodes | step | accept | == AR |", "|---|---:|---:|---:|---:|---|"]
        est = dr.get("estimates") or {}
        for name, e in est.items():
            v = e.get("verify_in_ar") or {}
            vs = " / ".join(_f(v.get(n, v.get(str(n))), ".2f") for n in (2, 8, 23))
            lines.append(f"| {name} (auto's estimates) | {_f(e.get('draft_in_ar'), '.2f')} | {vs} | | | |")
        for mode in ("chain", "ddtree"):
            m = dr.get(f"mtp_{mode}") or {}
            lines.append(f"| MTP head, {mode} | {_f(m.get('draft_in_ar'), '.2f')} | {_f(m.get('verify_in_ar'), '.2f')} "
                         f"| {_f(m.get('step_in_ar'), '.2f')} | {_f(m.get('accept_length'), '.2f')} | {m.get('eq_ar')} |")
        au = dr.get("auto") or {}
        lines += ["", f"auto over head + DFlash + lookup: {_f(au.get('tok_s'))} tok/s, {_f(au.get('vs_ar'), '.2f')}x AR; "
                      f"its AR steps {_f(au.get('ar_step_in_ar'), '.3f')} AR steps (what carrying the drafters costs); "
                      f"trees {au.get('trees_by_drafter')}; == AR {au.get('eq_ar')}"]
    for name, prof in (rec.get("profile") or {}).items():
        lines += ["", f"| {name} step, op by op ({_f(prof.get('ms_per_step'), '.3f')} ms of GPU time a step) | ms a "
                      "step | calls a step | GB/s |", "|---|---:|---:|---:|"]
        for o in prof["ops"][:16]:
            lines.append(f"| {o['op']} | {_f(o['ms_per_step'], '.3f')} | {_f(o['calls_per_step'], '.1f')} | "
                         f"{_f(o['gb_s'], '.0f')} |")
    for shape, table in (rec.get("matmul") or {}).items():
        ns = list(next(iter(table.values())).keys()) if table else []
        lines += ["", f"matmul {shape}: GB/s of weights read (copy bandwidth {_f(rec.get('copy_gb_s'), '.0f')} GB/s)",
                  "", "| format | " + " | ".join(f"n={n}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
        for fmt, row in table.items():
            lines.append(f"| {fmt} | " + " | ".join(_f(row[n]["gb_s"], ".0f") for n in ns) + " |")
    if rec.get("matvec"):
        pins = ["auto"] + [str(p) for p in MATVEC_ROWS if p] + ["mma"]
        lines += ["", "K-quant matvec: GB/s of weights read by rows per CTA (dfl_cuda_matvec_rows; every choice the "
                  "same bits; n=23 on few rows: the matvec 8 tokens a pass vs the tensor cores, mma)", "", "| shape | n | " + " | ".join(pins) + " | best |", "|---|---:|" + "---:|" * len(pins) + "---|"]
        for shape, table in rec["matvec"].items():
            for n, row in table.items():
                lines.append(f"| {shape} | {n} | " + " | ".join(_f(_get(row, p, "gb_s"), ".0f") for p in pins) +
                             f" | {row.get('best', '—')} |")
    if rec.get("mma_verify"):
        keys = [k for _, k in MMA_SPLITS]
        lines += ["", "K-quant verify on the tensor cores: GB/s of weights read by K split (dfl_cuda_mma_split: the "
                  "streaming kernel with 1, 2, 4 warps a row group; sync = the round-synchronous kernel; tiled = the "
                  "shared-memory tiles of prefill chunks; every "
                  "choice the same bits)", "", "| shape | n | " + " | ".join(keys) + " | best |",
                  "|---|---:|" + "---:|" * len(keys) + "---|"]
        for shape, table in rec["mma_verify"].items():
            for n, row in table.items():
                lines.append(f"| {shape} | {n} | " + " | ".join(_f(_get(row, k, "gb_s"), ".0f") for k in keys) +
                             f" | {row.get('best', '—')} |")
    if rec.get("notes"):
        lines += ["", "notes:"] + [f"- {n}" for n in rec["notes"]]
    return "\n".join(lines) + "\n"


def part_record(parts_dir: str, out_dir: str, commit: str | None, device: str | None) -> Path:
    parts = {}
    for name in ("exact", "checks", "llamacpp", "ours", "matmul", "vram24", "vram24_262k", "prefix", "draftmodel",
                 "slots", "drafters", "matvec"):
        p = Path(parts_dir) / f"{name}.json"
        if p.is_file():
            parts[name] = json.loads(p.read_text())
    now = _dt.datetime.now(_dt.timezone.utc)
    rec = assemble(parts, commit, device, now)
    out = Path(out_dir) / f"gpu-{now.strftime('%Y%m%d-%H%M')}.json"
    _write(out, rec)
    out.with_suffix(".md").write_text(markdown(rec))
    print(markdown(rec))
    return out


# ----------------------------------------------------------------------------------------------- main
def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)

    e = sub.add_parser("exact", help="the four exactness checks on the bundled pair")
    e.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    e.add_argument("--n-new", type=int, default=128)
    e.add_argument("--threads", type=int, default=4)
    e.add_argument("--out", required=True)

    c = sub.add_parser("checks", help="test and sanitizer logs -> tests / sanitizer")
    c.add_argument("--junit", action="append", default=[], help="pytest --junitxml file (repeatable)")
    c.add_argument("--backend-ops", help="the backend op test's log")
    c.add_argument("--memcheck", action="append", default=[], help="a compute-sanitizer memcheck log (repeatable)")
    c.add_argument("--racecheck", action="append", default=[], help="a compute-sanitizer racecheck log (repeatable)")
    c.add_argument("--out", required=True)

    ll = sub.add_parser("llamacpp", help="llama-bench on the same file")
    g = ll.add_mutually_exclusive_group(required=True)
    g.add_argument("--bench", help="the llama-bench binary")
    g.add_argument("--json", dest="json_in", help="parse this llama-bench -o json output instead of running")
    ll.add_argument("--model", help="the GGUF file (with --bench)")
    ll.add_argument("-n", "--n-gen", type=int, default=128)
    ll.add_argument("-p", "--prompts", default="512,8192")
    ll.add_argument("-r", "--reps", type=int, default=3)
    ll.add_argument("--out", required=True)

    o = sub.add_parser("ours", help="our decode, prefill, steps, oracle, memory")
    o.add_argument("--target", help="target GGUF [default: the bundled pair]")
    o.add_argument("--draft", help="drafter directory [default: the bundled drafter with the bundled target]")
    o.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    o.add_argument("--ctx", type=int, default=8192 + 512)
    o.add_argument("--kv-type", default="f16")
    o.add_argument("--threads", type=int, default=4)
    o.add_argument("--n-decode", type=int, default=128)
    o.add_argument("--prefill", type=_ints, default=[512, 8192])
    o.add_argument("--nodes", type=_ints, default=list(VERIFY_NODES))
    o.add_argument("--repeats", type=int, default=3)
    o.add_argument("--steps-tokens", type=int, default=24, help="tokens per step-timing run")
    o.add_argument("--oracle-block", type=int, default=8, help="block size of the oracle run (accept length ~ it)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", required=True)

    mv = sub.add_parser("matvec", help="the K-quant matvec on the AR step's shapes, every rows-per-CTA choice")
    mv.add_argument("--n", type=_ints, default=[1, 8])
    mv.add_argument("--out", required=True)

    m = sub.add_parser("matmul", help="the CUDA matmul table (every format, FFN shapes)")
    m.add_argument("--n", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 512])
    m.add_argument("--formats", default=",".join(MATMUL_FORMATS))
    m.add_argument("--out", required=True)

    v = sub.add_parser("vram24", help="target + drafter under a 24 GiB cap (ballast), DDTree == AR")
    v.add_argument("--target", required=True)
    v.add_argument("--draft", required=True)
    v.add_argument("--cap-gib", type=float, default=24.0)
    v.add_argument("--ctx", type=int, default=131072)
    v.add_argument("--prompt-len", type=int, default=4096)
    v.add_argument("-n", "--n-new", type=int, default=64)
    v.add_argument("--kv-type", default="q4_0")
    v.add_argument("--draft-type", default=None, choices=("bf16", "q8_0"))
    v.add_argument("--threads", type=int, default=4)
    v.add_argument("--out", required=True)

    def decode_part(name: str, desc: str, n_new: int = 64, ctx: int | None = 2048):
        """A part that decodes on a target (and drafter): the options they share; --out required."""
        p = sub.add_parser(name, help=desc)
        p.add_argument("--target")
        p.add_argument("--draft")
        p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
        p.add_argument("-n", "--n-new", type=int, default=n_new)
        p.add_argument("--threads", type=int, default=4)
        if ctx is not None:
            p.add_argument("--ctx", type=int, default=ctx)
        p.add_argument("--out", required=True)
        return p

    dmp = decode_part("draftmodel", "a small qwen35 GGUF drafting for the target: step costs", ctx=None)
    dmp.add_argument("--blocks", type=_ints, default=[5, 9])
    decode_part("drafters", "the MTP head, lookup and the portfolio on the 27B: costs in AR steps")
    slp = decode_part("slots", "several requests at once: N streams' aggregate tok/s vs one stream")
    slp.add_argument("--slots", type=int, default=4)

    pp = decode_part("prefix", "the prefix cache: turn 2 of a long conversation vs turn 1", n_new=32, ctx=8192 + 512)
    pp.add_argument("--history", type=int, default=8192)
    pp.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("record", help="assemble the parts into bench/results/gpu-*.json + .md")
    r.add_argument("--parts", required=True)
    r.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    r.add_argument("--commit", default=None)
    r.add_argument("--device-name", default=None)

    a = ap.parse_args(argv)
    if a.part == "exact":
        _write(a.out, part_exact(a.device, a.n_new, a.threads))
    elif a.part == "checks":
        _write(a.out, part_checks(a.junit, a.backend_ops, a.memcheck, a.racecheck))
    elif a.part == "llamacpp":
        if a.bench and not a.model:
            ap.error("llamacpp --bench needs --model")
        _write(a.out, part_llamacpp(a.bench, a.model, a.json_in, a.n_gen, a.prompts, a.reps))
    elif a.part == "ours":
        _write(a.out, part_ours(a.target, a.draft, a.device, a.ctx, a.kv_type, a.threads, a.n_decode, a.prefill,
                                a.nodes, a.repeats, a.steps_tokens, a.oracle_block, a.seed,
                                checkpoint=lambda o: _write(a.out, o)))
    elif a.part == "vram24":
        _write(a.out, part_vram24(a.target, a.draft, a.cap_gib, a.ctx, a.prompt_len, a.n_new, a.kv_type, a.draft_type,
                                  a.threads))
    elif a.part == "draftmodel":
        _write(a.out, part_draftmodel(a.target, a.draft, a.device, a.n_new, a.threads, a.blocks))
    elif a.part == "drafters":
        _write(a.out, part_drafters(a.target, a.draft, a.device, a.n_new, a.threads, a.ctx))
    elif a.part == "slots":
        _write(a.out, part_slots(a.target, a.draft, a.device, a.n_new, a.threads, a.slots, a.ctx))
    elif a.part == "prefix":
        _write(a.out, part_prefix(a.target, a.draft, a.device, a.history, a.n_new, a.ctx, a.threads, a.seed))
    elif a.part == "matvec":
        if any(n < 1 or n > 8 for n in a.n):
            ap.error("matvec: --n takes token counts 1..8 (more take the tensor-core kernel)")
        _write(a.out, part_matvec(a.n, checkpoint=lambda o: _write(a.out, o)))
    elif a.part == "matmul":
        bad = [f for f in a.formats.split(",") if f not in MATMUL_FORMATS]
        if bad:
            ap.error(f"unknown format(s) {', '.join(bad)}: choose from {', '.join(MATMUL_FORMATS)}")
        _write(a.out, part_matmul(a.n, a.formats.split(",")))
    else:
        part_record(a.parts, a.out_dir, a.commit, a.device_name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
