"""The CUDA kernels' memory traffic per warp instruction, measured on the CPU emulator (no GPU needed).

The emulator built with -DDFLASH27B_CUDA_EMU_MEMTRACE=ON (csrc/backend/cuda/emu/memtrace.cpp) sees every load
and store an emulated CUDA thread makes.  For each kernel this prints what a profiler would say about its
memory instructions on a GPU, before any GPU is lent:

  - sector efficiency: the fewest 32-byte sectors that could hold a warp instruction's distinct global bytes
    over the sectors it touches (1.0: coalesced; 0.125: each lane's 4 bytes in a sector of its own);
  - bytes / instruction: a warp's distinct global bytes per load (512 for 16-byte lanes; a stream of 1-byte
    loads keeps the load units busy for little);
  - cache reads / DRAM: the sectors the instructions touch over the distinct sectors the launch reads, what the
    L1 / L2 serve again (a weight pass should read its bytes about once);
  - shared conflicts: shared-memory wavefronts over the conflict-free count (1.0: no bank conflict);
  - dram MB: distinct global bytes a launch reads, summed over launches: the floor of its DRAM traffic.

Cases: the matmuls of a Qwen3.5-27B step (every weight shape of an AR step at 1 token and of a DDTree-22
verify at 23, exactly as the forward calls them; a 512-token prefill chunk on fewer rows), and a synthetic
0.8B's forward on the emulated device (an AR step and a 23-node tree verify after an 8-token prompt: the
attention, delta-net, norm and top-k kernels at Qwen3.5's head shapes).

  python bench/emu_memtrace.py --build --out bench/results/emu-memtrace.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "emu-memtrace"

# block bytes / values, and where each block's f16 scales sit (set to small numbers: random bits make inf / NaN)
BLOCKS = {"q4_k": (12, 144, 256, (0, 2)), "q5_k": (13, 176, 256, (0, 2)), "q6_k": (14, 210, 256, (208,)),
          "q8_0": (8, 34, 32, (0,))}
# (type, rows, cols, calls a step) of a Qwen3.5-27B Q4_K_M step (llama.cpp's type mix; the H100 record's shapes)
SHAPES_27B = [("q4_k", 17408, 5120, 128), ("q6_k", 5120, 17408, 32), ("q4_k", 5120, 17408, 32),
              ("q4_k", 48, 5120, 96), ("q4_k", 5120, 6144, 64), ("q6_k", 10240, 5120, 24),
              ("q4_k", 6144, 5120, 48), ("q4_k", 10240, 5120, 24), ("q4_k", 1024, 5120, 24),
              ("q4_k", 12288, 5120, 16), ("q6_k", 248320, 5120, 1)]


def build(out: Path = BUILD) -> Path:
    cmake = shutil.which("cmake")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(ROOT), "-B", str(out), *gen, "-DCMAKE_BUILD_TYPE=Release", "-DDFLASH27B_CUDA=OFF",
                    "-DDFLASH27B_CUDA_EMU=ON", "-DDFLASH27B_CUDA_EMU_MEMTRACE=ON"], check=True, capture_output=True)
    subprocess.run([cmake, "--build", str(out), "--target", "dflash27b", "-j", str(os.cpu_count() or 2)], check=True,
                   capture_output=True)
    return out / "libdflash27b.so"


class Tracer:
    def __init__(self, lib: Path):
        self.lib = lib
        self.c = ctypes.CDLL(str(lib))
        self.c.dfl_emu_memtrace_dump.argtypes = [ctypes.c_char_p]
        self._names: dict[tuple[str, str], tuple[str, str]] = {}

    def run(self, fn) -> list[dict]:
        """fn's kernels, each with its counts and sites resolved to source lines."""
        self.c.dfl_emu_memtrace_reset()
        fn()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            if self.c.dfl_emu_memtrace_dump(f.name.encode()) != 0:
                raise RuntimeError("dfl_emu_memtrace_dump failed")
            kernels = json.load(open(f.name))["kernels"]
        self._resolve(kernels)
        return kernels

    def _resolve(self, kernels: list[dict]) -> None:
        want = {(k["object"], k["offset"], True) for k in kernels}
        want |= {(s["object"], s["offset"], False) for k in kernels for s in k["sites"]}
        by_obj: dict[str, list[tuple[str, bool]]] = {}
        for obj, off, entry in want:
            if (obj, off) not in self._names and obj:
                by_obj.setdefault(obj, []).append((off, entry))
        for obj, offs in by_obj.items():
            # a site's address is the instrumented call's return: the access is the instruction before it
            addrs = [off if entry else hex(int(off, 16) - 1) for off, entry in offs]
            out = subprocess.run(["addr2line", "-e", obj, "-f", "-C", "-i", "-a", *addrs], capture_output=True,
                                 text=True).stdout.splitlines()
            frames: list[list[str]] = []
            for ln in out:
                if ln.startswith("0x"):
                    frames.append([])
                else:
                    frames[-1].append(ln)
            for (off, _), fr in zip(offs, frames):
                funcs, lines = fr[0::2], [re.sub(r" \(discriminator \d+\)", "", x) for x in fr[1::2]]
                # the innermost place (a helper's load) and the kernel's own line it was inlined into
                inner = _short_path(lines[0]) if lines else "?"
                outer = _short_path(lines[-1]) if lines else "?"
                self._names[(obj, off)] = (funcs[-1] if funcs else "?", inner if inner == outer else f"{inner} <- {outer}")
        for k in kernels:
            k["name"] = _short_name(self._names.get((k["object"], k["offset"]), ("?", ""))[0])
            for s in k["sites"]:
                s["where"] = self._names.get((s["object"], s["offset"]), ("", "?"))[1]


def _short_path(line: str) -> str:
    return re.sub(r".*/csrc/", "", line)


def _short_name(f: str) -> str:
    f = f.replace("dfl::cuda::", "").replace("(anonymous namespace)::", "").replace("dfl::", "")
    if f.endswith(")"):   # the parameter list: from the "(" that closes the name's last ")"
        depth = 0
        for i in range(len(f) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(f[i], 0)
            if depth == 0:
                f = f[:i]
                break
    f = re.sub(r"^void ", "", f)
    return f if len(f) <= 90 else f[:87] + "..."


def _ratio(a, b):
    return round(a / b, 3) if b else None


# A roofline of one H100 SXM (a model, not a measurement): DRAM at the copy rate the first GPU record measured
# (3007 GB/s read + write), one shared-memory wavefront a clock per SM (132 SMs at 1.755 GHz), the tensor
# cores' dense int8 / tf32 multiply-adds (1979 / 495 T ops a second, halved to MACs).
H100 = {"dram_b_s": 3.007e12, "wavefronts_s": 132 * 1.755e9, "int8_mac_s": 1979e12 / 2, "tf32_mac_s": 495e12 / 2}


def roofline(k: dict) -> dict:
    """Each resource's time for the kernel's launches at the H100's rates, and which one bounds it."""
    waves = sum(k.get(f"shared_{rw}", {}).get("wavefronts", 0) for rw in ("read", "write"))
    t = {"dram_us": (k["dram_read_bytes"] + k["dram_write_bytes"]) / H100["dram_b_s"] * 1e6,
         "smem_us": waves / H100["wavefronts_s"] * 1e6,
         "mma_us": (k.get("mma_int8", 0) * 16 * 8 * 32 / H100["int8_mac_s"] +
                    k.get("mma_tf32", 0) * 16 * 8 * 8 / H100["tf32_mac_s"]) * 1e6}
    out = {key: round(v, 3) for key, v in t.items()}
    out["bound"] = max(t, key=t.get).removesuffix("_us")
    return out


def summarize(k: dict) -> dict:
    g, gw = k.get("global_read", {}), k.get("global_write", {})
    sr, sw = k.get("shared_read", {}), k.get("shared_write", {})
    out = {"kernel": k["name"], "launches": k["launches"], "ctas": k["ctas"], "threads": k["threads"],
           "mma_int8": k.get("mma_int8", 0), "mma_tf32": k.get("mma_tf32", 0), "h100_model": roofline(k),
           "dram_read_mb": round(k["dram_read_bytes"] / 1e6, 3), "dram_write_mb": round(k["dram_write_bytes"] / 1e6, 3),
           "read_sector_efficiency": _ratio(g.get("ideal", 0), g.get("sectors", 0)),
           "read_bytes_per_instruction": _ratio(g.get("bytes", 0), g.get("instructions", 0)),
           "cache_reads_per_dram": _ratio(32 * g.get("sectors", 0), k["dram_read_bytes"]),
           "write_sector_efficiency": _ratio(gw.get("ideal", 0), gw.get("sectors", 0)),
           "shared_read_conflicts": _ratio(sr.get("wavefronts", 0), sr.get("ideal", 0)),
           "shared_write_conflicts": _ratio(sw.get("wavefronts", 0), sw.get("ideal", 0))}
    # places of the source (an unrolled loop's copies are one place), their excess over the ideal
    places: dict[tuple[str, str], dict] = {}
    for s in k["sites"]:
        for kind in ("global_read", "global_write", "shared_read", "shared_write"):
            if kind in s:
                acc = places.setdefault((s["where"], kind), dict.fromkeys(("instructions", "bytes", "units", "ideal"), 0))
                c = s[kind]
                for f in ("instructions", "bytes", "ideal"):
                    acc[f] += c[f]
                acc["units"] += c["sectors" if kind.startswith("global") else "wavefronts"]
    worst = []
    for (where, kind), c in places.items():
        if c["units"] > c["ideal"]:
            unit = "sectors" if kind.startswith("global") else "wavefronts"
            worst.append({"where": where, "kind": kind, "excess": c["units"] - c["ideal"],
                          "per_instruction": f"{c['units'] / c['instructions']:.1f} {unit} for "
                                             f"{c['bytes'] / c['instructions']:.0f} B (ideal {c['ideal'] / c['instructions']:.1f})"})
    worst.sort(key=lambda w: -w["excess"])
    out["worst_sites"] = worst[:4]
    # where the shared-memory time goes, conflicts or not (a kernel bound by wavefronts it needs shows nothing
    # in worst_sites: the tiled attention's q fragments, read by every warp, were 20% of its wavefronts)
    shared = {k: v for k, v in places.items() if k[1].startswith("shared")}
    total = sum(v["units"] for v in shared.values())
    out["busiest_shared_sites"] = [
        {"where": where, "kind": kind, "share": round(c["units"] / total, 3),
         "per_instruction": f"{c['units'] / c['instructions']:.1f} wavefronts for {c['bytes'] / c['instructions']:.0f} B"}
        for (where, kind), c in sorted(shared.items(), key=lambda x: -x[1]["units"])[:4]] if total else []
    return out


def random_weight(kind: str, rows: int, cols: int, rng) -> tuple[int, np.ndarray]:
    tid, bsize, per, scales = BLOCKS[kind]
    nb = cols // per
    w = rng.integers(0, 256, size=(rows, nb, bsize), dtype=np.uint8)
    for off in scales:
        w[:, :, off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return tid, w.reshape(rows, nb * bsize)


def matmul_cases(tr: Tracer, quick: bool) -> list[dict]:
    from dflash27b._lib import load
    ffi, lib = load()
    rng = np.random.default_rng(0)
    cases = [(k, r, c, 1, calls) for k, r, c, calls in SHAPES_27B]
    cases += [(k, r, c, 23, calls) for k, r, c, calls in SHAPES_27B if k != "q6_k" or r != 248320]
    cases += [("q4_k", 1024, 5120, 512, 0), ("q6_k", 1024, 5120, 512, 0)]
    if quick:
        cases = [("q4_k", 1024, 5120, 1, 0), ("q4_k", 48, 5120, 23, 0), ("q6_k", 256, 5120, 23, 0)]
    out = []
    for kind, rows, cols, n, calls in cases:
        tid, w = random_weight(kind, rows, cols, rng)
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = np.zeros((n, rows), np.float32)

        def go():
            rc = lib.dfl_cuda_matmul_exact(tid, ffi.cast("void*", w.ctypes.data), rows, cols,
                                           ffi.cast("float*", x.ctypes.data), n, ffi.cast("float*", y.ctypes.data))
            assert rc == 0
        t0 = time.perf_counter()
        ks = tr.run(go)
        row = {"case": f"matmul {kind} {rows}x{cols} n={n}", "calls_per_27b_step": calls,
               "weight_mb": round(w.nbytes / 1e6, 3), "kernels": [summarize(k) for k in ks]}
        out.append(row)
        print(f"  {row['case']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def traced_steps(p: int) -> dict:
    """The forward steps traced after p tokens: an AR step, and a 23-node tree verify whose tree is a binary heap
    (node i's parent (i - 1) / 2, five levels deep): name -> (tokens, positions, parents)."""
    return {"ar step": ([7], [p], None),
            "tree verify 23": ([7 + i for i in range(23)], [p + (i + 1).bit_length() - 1 for i in range(23)],
                               [-1] + [(i - 1) // 2 for i in range(1, 23)])}


def forward_cases(tr: Tracer, model: Path) -> list[dict]:
    from dflash27b import Decoder
    out = []
    t0 = time.perf_counter()
    with Decoder(model, device="cuda", ctx=256, threads=2) as d:
        ids = list(range(1000, 1008))
        d.generate(ids, 2, mode="ar", ignore_eos=True, cache=False)   # prompt prefilled, one step
        print(f"  loaded and prefilled: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        ctx = d._ctx
        p = ctx.n_past
        for name, (toks, pos, par) in traced_steps(p).items():
            t0 = time.perf_counter()
            # the output head's logits for one row (the head's matmul is the matmul part's)
            ks = tr.run(lambda: ctx.forward(toks, pos=pos, parent=par, logit_rows=[0], commit=False))
            out.append({"case": f"0.8b {name}", "kernels": [summarize(k) for k in ks]})
            print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def step_totals(rows: list[dict]) -> dict:
    """The 27B step's matmuls at the model's DRAM rate, each shape times its calls a step: an AR step (1 token)
    and a 23-node verify (the output head's 23 rows taken as its 1-token pass: the same weights once)."""
    t = {1: 0.0, 23: 0.0}
    head = None
    for r in rows:
        calls = r.get("calls_per_27b_step", 0)
        n = int(r["case"].rsplit("n=", 1)[1]) if r["case"].startswith("matmul") else 0
        us = sum(k["h100_model"]["dram_us"] for k in r["kernels"])
        if calls and n in t:
            t[n] += us * calls
        if calls == 1 and n == 1:
            head = us
    if not t[1] or head is None:
        return {}
    verify = t[23] + head
    return {"ar_step_ms": round(t[1] / 1e3, 3), "verify23_ms": round(verify / 1e3, 3),
            "verify_over_ar": round(verify / t[1], 3)}


def case_totals(rows: list[dict]) -> dict:
    """Each case's kernels, each at its own bound (the largest of its DRAM, shared-memory and mma times) and
    summed: the model's time for a forward step, launch gaps and overlap left out."""
    return {r["case"]: round(sum(max(k["h100_model"][f] for f in ("dram_us", "smem_us", "mma_us"))
                                 for k in r["kernels"]), 1) for r in rows}


def attention_case(tr: Tracer, n_past: int = 1024) -> list[dict]:
    """traced_steps (an AR step, a 23-node tree verify) of the bundled tiny target after an
    n_past-token prompt (F16 KV): does attention read each K / V byte from DRAM once, and what does a verify's
    tile cost in shared memory?  (The prefill is emulated too: about 6 minutes at 1,024 tokens.)"""
    from dflash27b import Decoder
    out = []
    with Decoder(device="cuda", ctx=n_past + 64, threads=2, kv_type="f16") as d:
        d.generate([100 + (i * 7) % 3000 for i in range(n_past)], 2, mode="ar", ignore_eos=True, cache=False)
        ctx = d._ctx
        p = ctx.n_past
        for name, (toks, pos, par) in traced_steps(p).items():
            ks = tr.run(lambda: ctx.forward(toks, pos=pos, parent=par, logit_rows=[0], commit=False))
            out.append({"case": f"tiny {name} after {p} tokens", "kernels": [summarize(k) for k in ks]})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| case | kernel | launches | dram MB | sector eff. | B / instr | cache / dram | smem conflicts r / w "
             "| H100 model us: dram / smem / mma (bound) |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        for k in r["kernels"]:
            m = k["h100_model"]
            lines.append(f"| {r['case']} | `{k['kernel']}` | {k['launches']} | {k['dram_read_mb']} | "
                         f"{k['read_sector_efficiency']} | {k['read_bytes_per_instruction']} | "
                         f"{k['cache_reads_per_dram']} | {k['shared_read_conflicts']} / {k['shared_write_conflicts']} | "
                         f"{m['dram_us']} / {m['smem_us']} / {m['mma_us']} ({m['bound']}) |")
    lines.append("")
    lines.append("Busiest shared-memory places (their share of the kernel's wavefronts):")
    for r in rows:
        for k in r["kernels"]:
            for w in k.get("busiest_shared_sites", [])[:2]:
                if w["share"] >= 0.15:
                    lines.append(f"- {r['case']}, `{k['kernel'][:50]}`: {w['share']:.0%} {w['kind']} at {w['where']}: "
                                 f"{w['per_instruction']}")
    lines.append("")
    lines.append("Worst places (excess sectors or wavefronts over the whole case):")
    for r in rows:
        for k in r["kernels"]:
            for w in k["worst_sites"][:2]:
                lines.append(f"- {r['case']}, `{k['kernel'][:50]}`: {w['kind']} at {w['where']}: {w['per_instruction']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="store_true", help="configure and build build/emu-memtrace first")
    ap.add_argument("--lib", type=Path, default=BUILD / "libdflash27b.so")
    ap.add_argument("--parts", default="matmul,forward", help="matmul, forward, attention (an AR step after a "
                    "1,024-token prompt on the tiny target: K / V traffic at length)")
    ap.add_argument("--model", type=Path, default=Path("/tmp/dflash27b-bench/qwen35-0.8b-q4_k_m.gguf"),
                    help="the forward part's GGUF (default: bench/ar.py's synthetic 0.8B, written once)")
    ap.add_argument("--quick", action="store_true", help="three small matmuls (the test's case)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    lib = build() if a.build else a.lib
    os.environ["DFLASH27B_LIB"] = str(lib)
    sys.path.insert(0, str(ROOT / "python"))
    tr = Tracer(lib)
    rows = []
    parts = a.parts.split(",")
    if "matmul" in parts:
        rows += matmul_cases(tr, a.quick)
    if "attention" in parts:   # (not in the default parts)
        rows += attention_case(tr)
    if "forward" in parts:
        sys.path.insert(0, str(ROOT / "bench"))
        from ar import ensure_model
        rows += forward_cases(tr, ensure_model(a.model, "0.8b"))
    print(markdown(rows))
    totals = step_totals(rows)
    if totals:
        print(f"\n27B step matmuls at the model's DRAM rate: AR {totals['ar_step_ms']} ms, a 23-node verify "
              f"{totals['verify23_ms']} ms ({totals['verify_over_ar']}x)")
    per_case = case_totals([r for r in rows if not r["case"].startswith("matmul")])
    for case, us in per_case.items():
        print(f"{case}: {us} us in the model (each kernel at its bound, summed)")
    if a.out:
        a.out.write_text(json.dumps({"bench": "emu_memtrace", "commit": _commit(), "h100_model": H100,
                                     "step_totals": totals, "case_totals_us": per_case, "cases": rows},
                                    indent=1) + "\n")
    return 0


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
