"""Multi-turn chat through the daemon with and without the prefix cache: time to the first token per turn.

A conversation of `--turns` turns on the bundled pair: turn 1 is a ~1,500-token history (Python source),
every later turn is the previous prompt + its reply + 24 new tokens, as a chat client sends it.  The same
conversation runs against a daemon with `--cache-mem` and one with `--cache-mem 0`; every reply is checked
equal between the two.  Then 200 distinct conversations through the cached daemon, its RSS and cache bytes
against the budget.  Writes bench/results/prefix-cache-cpu.json.

    python bench/prefix_cache.py [--threads 2] [--turns 4] [--cache-gib 0.25]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from ar import cpu_name  # noqa: E402
from test_daemon import _wait_socket  # noqa: E402

from dflash27b import Decoder  # noqa: E402


def serve(sock: str, threads: int, cache_gib: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, "-c", "8192",
                             "-t", str(threads), "--cache-mem", str(cache_gib)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_socket(sock, proc)
    return proc


def turn(remote, prompt: list[int], n: int) -> tuple[float, list[int], dict]:
    t0 = time.perf_counter()
    first, tokens, stats = None, [], {}
    for ev in remote.events(prompt, n, ignore_eos=True, stream=True):
        if ev["event"] == "token" and ev["ids"] and first is None:
            first = time.perf_counter() - t0
        if ev["event"] == "done":
            tokens, stats = ev["tokens"], ev["stats"]
    return first, tokens, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reply", type=int, default=48)
    ap.add_argument("--cache-gib", type=float, default=0.25)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefix-cache-cpu.json"))
    a = ap.parse_args()
    src = (ROOT / "python" / "dflash27b" / "decoder.py").read_text() + (ROOT / "python" / "dflash27b" / "cli.py").read_text()
    with Decoder(device="cpu", threads=1) as d:
        text = d.tokenize(src)
    out: dict = {"machine": cpu_name(), "threads": a.threads, "turns": {}, "cache_gib": a.cache_gib}
    replies = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, gib in (("cold", 0.0), ("cached", a.cache_gib)):
            sock = f"{tmp}/{label}.sock"
            proc = serve(sock, a.threads, gib)
            try:
                remote = Decoder.connect(sock)
                prompt, rows = text[:1500], []
                for k in range(a.turns):
                    ttft, reply, stats = turn(remote, prompt, a.reply)
                    rows.append({"prompt_tokens": len(prompt), "cached_tokens": stats.get("cached_tokens", 0),
                                 "ttft_s": ttft, "reply": reply})
                    prompt = prompt + reply + text[1500 + 24 * k:1524 + 24 * k]
                replies[label] = [r.pop("reply") for r in rows]
                out["turns"][label] = rows
                if label == "cached":
                    rss0 = remote.health()["rss_bytes"]
                    for i in range(a.conversations):
                        start = (i * 53) % (len(text) - 700)
                        remote.generate(text[start:start + 300 + i % 300], 8, ignore_eos=True)
                    h = remote.health()
                    out["conversations"] = {"n": a.conversations, "rss_before": rss0, "rss_after": h["rss_bytes"],
                                            "cache": h["cache"]}
            finally:
                Decoder.connect(sock).shutdown()
                proc.wait(30)
    out["replies_equal"] = replies["cold"] == replies["cached"]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft cold':>10} {'ttft cached':>12} {'ratio':>6}")
    for k, (c, w) in enumerate(zip(out["turns"]["cold"], out["turns"]["cached"])):
        print(f"{k + 1:4d} {c['prompt_tokens']:7d} {w['cached_tokens']:7d} {c['ttft_s'] * 1e3:8.1f}ms "
              f"{w['ttft_s'] * 1e3:10.1f}ms {w['ttft_s'] / c['ttft_s']:6.2f}")
    later = [w["ttft_s"] / c["ttft_s"] for c, w in zip(out["turns"]["cold"][1:], out["turns"]["cached"][1:])]
    out["median_later_turn_ratio"] = statistics.median(later) if later else None
    cv = out.get("conversations", {})
    if cv:
        print(f"{cv['n']} conversations: cache {cv['cache']['bytes'] / 2**20:.1f} of {cv['cache']['max_bytes'] / 2**20:.0f} "
              f"MiB ({cv['cache']['checkpoints']} checkpoints, {cv['cache']['evicted']} evicted); RSS "
              f"{cv['rss_before'] / 2**20:.0f} -> {cv['rss_after'] / 2**20:.0f} MiB")
    print(f"replies equal with and without the cache: {out['replies_equal']}")
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
