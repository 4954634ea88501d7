"""Warm time to first token through the daemon (Unix socket), against in-process, on CPU.

Starts `dflash27b serve` on the given pair (default: the bundled tiny pair), warms it up, then sends N
streaming requests one after another and records, per request, the wall time from writing the request
to reading the first token event, and the prefill time the engine itself reports.  TTFT minus prefill is
what the daemon adds (JSON, socket, queue, tokenizer).

  python bench/daemon_ttft.py [-m TARGET -md DRAFT] [--n 30] [--prompt-tokens 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--target")
    ap.add_argument("-md", "--draft")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from dflash27b import Decoder
    from dflash27b.decoder import bundled_pair

    target, draft = a.target, a.draft
    if target is None:
        pair = bundled_pair()
        if pair is None:
            sys.exit("no bundled pair in this install: pass -m TARGET [-md DRAFT]")
        target, draft = str(pair[0]), str(pair[1])
    sock = os.path.join(tempfile.mkdtemp(), "ttft.sock")
    cmd = [sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, "-m", target, "-t", str(a.threads)]
    if draft:
        cmd += ["-md", draft]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while True:
            try:
                Decoder.connect(sock).health()
                break
            except Exception:
                if time.time() - t0 > 120 or proc.poll() is not None:
                    sys.exit("daemon did not start")
                time.sleep(0.05)
        ids = [(7 * i) % 1000 + 5 for i in range(a.prompt_tokens)]

        def one() -> tuple[float, float]:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            f = s.makefile("rb")
            t = time.perf_counter()
            s.sendall((json.dumps({"prompt_ids": ids, "max_new_tokens": 4, "stream": True}) + "\n").encode())
            ttft = None
            for line in f:
                ev = json.loads(line)
                if ev["event"] == "token" and ttft is None:
                    ttft = time.perf_counter() - t
                if ev["event"] in ("done", "error"):
                    break
            s.close()
            return ttft, ev["stats"]["prefill_s"]

        for _ in range(3):
            one()
        runs = [one() for _ in range(a.n)]
        ttft = statistics.median(r[0] for r in runs) * 1e3
        pre = statistics.median(r[1] for r in runs) * 1e3
        over = statistics.median((r[0] - r[1]) for r in runs) * 1e3
        with Decoder(target, draft, threads=a.threads) as d:
            d.generate(ids, 4)
            local = []
            for _ in range(a.n):
                t = time.perf_counter()
                next(iter(d.stream_ids(ids, 4)))
                local.append(time.perf_counter() - t)
        print(f"target {os.path.basename(target)}, {a.prompt_tokens}-token prompt, {a.threads} threads, "
              f"median of {a.n}")
        print(f"| path | TTFT ms | engine prefill ms | TTFT - prefill ms |\n|---|---|---|---|")
        print(f"| daemon (unix socket) | {ttft:.1f} | {pre:.1f} | {over:.1f} |")
        print(f"| in-process Decoder | {statistics.median(local) * 1e3:.1f} | | |")
        return 0
    finally:
        try:
            Decoder.connect(sock).shutdown()
        except Exception:
            pass
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
