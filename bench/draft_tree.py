"""Which draft-tree scheme pays for a draft model: one greedy path with per-depth alternatives, or
expanding branches.

  * one pass (`expand=0`): the draft model runs its greedy chain, one token per forward, keeping each
    depth's top-K; the DDTree builder treats the depths as independent (as for a DFlash drafter);
  * expanding branches (`expand=w`): each depth runs the w most probable nodes of the depth before as one
    tree batch, so every node's probability is the draft's real conditional; the same number of draft
    forwards (one per depth), each over more tokens.

The pairs are made from the bundled target (trained on Python sources, 8 layers): draft models that are
really weaker than it, as a 0.8B is for the 27B, not its own quantised copy:
  * `firstN`: its first N layers (N = 4: 3 delta-net + 1 attention; N = 6) with its own head (a
    layer-skip draft);
  * `firstN-q4_0`: the same, quantised to Q4_0.
Every run must equal AR token for token; reported per scheme: mean accept length, draft and verify ms per
step, tok/s and the speedup over AR (CPU here: a draft forward's cost grows with its tokens, on a GPU it
hardly does below a few dozen, so the draft ms of the wider schemes is the CPU's worst case).

    python bench/draft_tree.py [--n-new 96] [--threads 2] [--budgets 8,22] [--expand 0,2,4] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from dflash27b import Decoder
from dflash27b.decoder import bundled_pair

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(path):\n", "class Stack:\n    def __init__(self):\n",
           "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
           "    def __repr__(self):\n        return ", "with open(path) as f:\n    for line in f:\n",
           "def _check_type(value, expected):\n    if not isinstance(", "try:\n    import json\nexcept ImportError:\n"]


def first_layers(src: Path, dst: Path, n_layers: int, quant: str | None = None) -> Path:
    """A draft model: the first n_layers blocks of a qwen35 GGUF with its embeddings, final norm and head
    (optionally its 2-D weights quantised to Q4_0 with gguf-py's reference quantiser)."""
    from gguf import GGMLQuantizationType as Q, quants
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = f.contents()
        if name == f"{arch}.block_count":
            val = n_layers
        elif name == f"{arch}.attention.recurrent_layers":
            val = val[:n_layers]
        elif name == "general.file_type" and quant:
            val = 2  # MOSTLY_Q4_0
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, val, f.types[0], sub)
    for t in r.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers:
            continue
        data = np.asarray(t.data)
        if quant and t.tensor_type in (Q.F16, Q.F32) and data.ndim == 2 and data.shape[-1] % 32 == 0 \
                and not t.name.startswith("token_embd"):
            q = quants.quantize(data.astype(np.float32), Q.Q4_0)
            w.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=Q.Q4_0)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def run(dec: Decoder, ids: list[list[int]], n_new: int, ar: list[list[int]] | None, **kw) -> dict:
    acc, draft_ms, verify_ms, toks, secs = [], [], [], 0, 0.0
    out = []
    for i, p in enumerate(ids):
        r = dec.generate(p, n_new, ignore_eos=True, **kw)
        out.append(r.tokens)
        if ar is not None and r.tokens != ar[i]:
            raise SystemExit(f"{kw}: prompt {i} differs from AR")
        s = r.stats
        acc.append(s.mean_accept)
        draft_ms.append(float(np.mean(s.draft_ms)) if s.draft_ms else 0.0)
        verify_ms.append(float(np.mean(s.verify_ms)) if s.verify_ms else 0.0)
        toks += max(s.generated_tokens - 1, 0)  # the first new token comes from the prefill
        secs += s.decode_s
    return {"accept": float(np.mean(acc)), "draft_ms": float(np.mean(draft_ms)),
            "verify_ms": float(np.mean(verify_ms)), "tok_s": toks / secs if secs else 0.0, "tokens": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budgets", default="8,22")
    ap.add_argument("--expand", default="0,1,2,4")
    ap.add_argument("--layers", default="4,6", help="draft models: the target's first N layers, for each N")
    ap.add_argument("--block-size", type=int, default=9, help="draft depth + 1 (8 draft tokens)")
    ap.add_argument("--work", default="/tmp/dflash27b-draft-tree")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft-tree-cpu.json"))
    a = ap.parse_args()
    target, _ = bundled_pair()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    drafts = {}
    for n in (int(x) for x in a.layers.split(",")):
        drafts[f"first{n}"] = first_layers(Path(target), work / f"first{n}.gguf", n)
        drafts[f"first{n}-q4_0"] = first_layers(Path(target), work / f"first{n}-q4_0.gguf", n, quant="q4_0")
    budgets = [int(x) for x in a.budgets.split(",")]
    expands = [int(x) for x in a.expand.split(",")]
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"CPU, {a.threads} threads", "target": "bundled",
              "n_new": a.n_new, "prompts": len(PROMPTS), "block_size": a.block_size, "pairs": {}}
    for name, draft in drafts.items():
        with Decoder(target, draft, device="cpu", threads=a.threads, ctx=2048) as dec:
            ids = [dec.tokenize(p) for p in PROMPTS]
            dec.generate(ids[0], 16, ignore_eos=True, mode="ar")  # warm-up
            ar = run(dec, ids, a.n_new, None, mode="ar")
            rows = {"ar": ar}
            rows["chain"] = run(dec, ids, a.n_new, ar["tokens"], mode="chain", block_size=a.block_size)
            for b in budgets:
                for e in expands:
                    rows[f"ddtree-{b} expand {e}"] = run(dec, ids, a.n_new, ar["tokens"], mode="ddtree",
                                                         block_size=a.block_size, budget=b, expand=e)
            for r in rows.values():
                r.pop("tokens")
                r["speedup"] = r["tok_s"] / ar["tok_s"]
            result["pairs"][name] = rows
            print(f"\n{name} (every run == AR)")
            print(f"{'run':24} {'accept':>7} {'draft ms':>9} {'verify ms':>10} {'tok/s':>8} {'speedup':>8}")
            for k, r in rows.items():
                print(f"{k:24} {r['accept']:7.2f} {r['draft_ms']:9.2f} {r['verify_ms']:10.2f} {r['tok_s']:8.1f} "
                      f"{r['speedup']:7.2f}x", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
