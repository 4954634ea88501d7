"""A DDTree verify's cost against a chain's of the same size on the CPU (synthetic 0.8B-shaped Q4_K_M).

A best-first tree of 23 nodes (the root and 22 drafted, DDTree-22's shape: drafted from per-depth candidates
whose top-1 carries 0.6-0.8 of the mass, as the builder does) is verified by one forward, and so is a 23-token
chain; the delta-net walks the tree in preorder (gdn_walk_order), so only a node after a leaf reloads its
parent's state.  The tree is passed in the builder's order and in preorder: the walk makes them the same work.
Prints the reloads and kept states of each order (what a walk in batch order would do) and the median times.

  python bench/tree_order_cpu.py [--reps 15] [--threads 2]
"""
from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ar import ensure_model  # noqa: E402


def best_first_tree(budget: int = 22, depths: int = 16, k: int = 22, seed: int = 1) -> list[tuple[int, int]]:
    """(parent, depth) of the root and `budget` nodes, in the order a best-first builder adds them."""
    rng = random.Random(seed)
    probs = []
    for _ in range(depths):
        top = rng.uniform(0.6, 0.8)
        rest = [rng.random() for _ in range(k - 1)]
        s = sum(rest)
        probs.append([top] + sorted(((1 - top) * x / s for x in rest), reverse=True))
    nodes, heap, seq = [(-1, 0)], [], 0

    def push(parent: int, depth: int, logw: float) -> None:
        nonlocal seq
        if depth > depths:
            return
        for r in range(k):
            heapq.heappush(heap, (-(logw + math.log(probs[depth - 1][r])), seq, parent, depth))
            seq += 1
    push(0, 1, 0.0)
    while heap and len(nodes) - 1 < budget:
        neg, _, parent, depth = heapq.heappop(heap)
        nodes.append((parent, depth))
        push(len(nodes) - 1, depth + 1, -neg)
    return nodes


def preorder(nodes: list[tuple[int, int]]) -> list[int]:
    kids: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for i, (p, _) in enumerate(nodes):
        if p >= 0:
            kids[p].append(i)
    order, stack = [], [0]
    while stack:
        u = stack.pop()
        order.append(u)
        stack.extend(reversed(kids[u]))
    return order


def reloads_and_keeps(parent: list[int]) -> tuple[int, int]:
    """What a walk in batch order does: nodes not after their parent, and the parents they reload."""
    moved = [t for t in range(1, len(parent)) if parent[t] != t - 1]
    return len(moved), len({parent[t] for t in moved})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    from dflash27b import Decoder
    nodes = best_first_tree()
    bf_par, bf_dep = [p for p, _ in nodes], [d for _, d in nodes]
    order = preorder(nodes)
    where = {u: i for i, u in enumerate(order)}
    po_par = [-1 if nodes[u][0] < 0 else where[nodes[u][0]] for u in order]
    po_dep = [nodes[u][1] for u in order]
    print("in batch order: builder's %d reloads / %d kept, preorder's %d / %d"
          % (*reloads_and_keeps(bf_par), *reloads_and_keeps(po_par)))
    model = ensure_model(Path("/tmp/dflash27b-bench") / "qwen35-0.8b-q4_k_m.gguf", "0.8b")
    with Decoder(model, threads=a.threads, ctx=1024) as d:
        d.generate(d.tokenize("def fibonacci(n):\n"), 2, mode="ar", ignore_eos=True, cache=False)
        ctx, p = d._ctx, d._ctx.n_past

        def once(par, dep) -> float:
            t0 = time.perf_counter()
            ctx.forward([5 + i for i in range(len(par))], pos=[p + x for x in dep], parent=par, commit=False)
            return time.perf_counter() - t0
        runs = {"builder's order": (bf_par, bf_dep), "preorder": (po_par, po_dep),
                "chain": (list(range(-1, len(nodes) - 1)), list(range(len(nodes))))}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(a.reps):   # alternated: the guest's speed drifts
            for k, (par, dep) in runs.items():
                times[k].append(once(par, dep))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print("  ".join(f"{k} {v:.1f} ms" for k, v in med.items()),
          f"| tree / chain {med[next(iter(med))] / med['chain']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
