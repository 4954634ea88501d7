"""Structured output's cost: tokens/s and mean accept length under a JSON schema against unconstrained, per
mode, with and without pruning the draft branches the schema forbids; the mask time per step as a share of
the step.  Every constrained run must equal constrained AR token for token (checked, reported).

The pair is the bundled one (a target and a drafter trained on Python): under a JSON schema the drafter's
Python drafts are mostly forbidden, the hardest case for speculation; the schema is a tool-call shape.  The
"tools" rows do the same with OpenAI tools (tool_choice required, one call, Qwen3.5's XML call format, chat
prompts rendered by the model's template with thinking off).

    python bench/constraint_cpu.py [--n-new 96] [--threads 2] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from dflash27b import Decoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ar import cpu_name  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["read_file", "write_file", "run_tests"]},
    "arguments": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40},
                                                    "line": {"type": "integer", "minimum": 1}},
                  "required": ["path"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string", "maxLength": 40}, "line": {"type": "integer", "minimum": 1, "maximum": 9999}},
    "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {
        "verbose": {"type": "boolean"}, "only": {"enum": ["unit", "slow", "all"]}}, "required": ["only"]}}}]
CHATS = [[{"role": "user", "content": c}] for c in ("Read the config file.", "Run the unit tests.",
                                                    "Show me line 3 of setup.py.", "What fails?")]
PROMPTS = ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "def parse_args(argv=None):\n"]


def run(d: Decoder, n_new: int, prompts=PROMPTS, **kw) -> tuple[list[list[int]], dict]:
    toks, acc, masks, steps, t0 = [], [], 0.0, 0.0, time.perf_counter()
    pruned = drafted = 0
    for p in prompts:
        r = d.generate(p, n_new, **kw)
        toks.append(r.tokens)
        acc += r.stats.accept_lengths
        masks += sum(r.stats.mask_ms)
        pruned += sum(r.stats.pruned)
        drafted += sum(r.stats.tree_size)
        steps += r.stats.decode_s * 1e3
    s = time.perf_counter() - t0
    n = sum(len(t) for t in toks)
    return toks, {"tok_s": round(n / s, 1), "tokens": n, "accept_length": round(sum(acc) / len(acc), 3) if acc else 0,
                  "mask_share_of_decode": round(masks / steps, 4) if steps else 0.0,
                  "drafted_nodes": drafted + pruned, "verified_draft_nodes": drafted, "pruned_nodes": pruned}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    doc = {"bench": "constraint_cpu", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "cores": os.cpu_count(),
           "threads": a.threads, "n_new": a.n_new, "prompts": len(PROMPTS), "schema": SCHEMA, "rows": {}}
    print(f"machine: {cpu_name()}, {a.threads} threads; {len(PROMPTS)} prompts x {a.n_new} tokens")
    with Decoder(threads=a.threads) as d:
        doc["pair"] = [d.target, d.draft]
        d.generate(PROMPTS[0], 8, mode="ddtree", json_schema=SCHEMA)  # warm-up: llguidance's vocabulary, the grammar
        ref, row = run(d, a.n_new, mode="ar", json_schema=SCHEMA)
        doc["rows"]["ar, schema"] = row
        _, doc["rows"]["ar, free"] = run(d, a.n_new, mode="ar", ignore_eos=True)
        for mode, kw in (("chain", {}), ("ddtree", {"budget": 22}), ("auto", {})):
            _, doc["rows"][f"{mode}, free"] = run(d, a.n_new, mode=mode, ignore_eos=True, **kw)
            for prune in (True, False):
                toks, row = run(d, a.n_new, mode=mode, json_schema=SCHEMA, grammar_prune=prune, **kw)
                row["equals_constrained_ar"] = toks == ref
                doc["rows"][f"{mode}, schema, {'pruned' if prune else 'unpruned'}"] = row
        tools = dict(prompts=CHATS, chat=True, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                     chat_template_kwargs={"enable_thinking": False}, cache=False)
        ref, doc["rows"]["ar, tools"] = run(d, a.n_new, mode="ar", **tools)
        free_chat = dict(prompts=CHATS, chat=True, ignore_eos=True, cache=False,
                         chat_template_kwargs={"enable_thinking": False})
        _, doc["rows"]["ar, chat, free"] = run(d, a.n_new, mode="ar", **free_chat)
        for mode, kw in (("chain", {}), ("ddtree", {"budget": 22}), ("auto", {})):
            _, doc["rows"][f"{mode}, chat, free"] = run(d, a.n_new, mode=mode, **free_chat, **kw)
            for prune in (True, False):
                toks, row = run(d, a.n_new, mode=mode, grammar_prune=prune, **tools, **kw)
                row["equals_constrained_ar"] = toks == ref
                doc["rows"][f"{mode}, tools, {'pruned' if prune else 'unpruned'}"] = row
    for k, v in doc["rows"].items():
        print(f"  {k:32s} {v['tok_s']:8.1f} tok/s  accept {v['accept_length']:.2f}  mask {v['mask_share_of_decode']:.1%}"
              f"  pruned {v['pruned_nodes']} of {v['drafted_nodes']} drafted" +
              (f"  == AR {v['equals_constrained_ar']}" if "equals_constrained_ar" in v else ""))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
