"""Test helpers (not tests): drive a speculative generation step by step, checking each commit; locate where
two backends' decodes part and by how much the reference's logits separated the two choices there."""
from __future__ import annotations

NEAR_TIE = 1e-3  # reference logit margin below which two backends (different summation orders) may differ


def divergence(ref_dec, ids: list[int], got: list[int], want: list[int]) -> tuple[int, float] | None:
    """None when got == want; else (k, margin): the first differing token and |logit(want[k]) - logit(got[k])|
    in ref_dec's row after ids + want[:k] (a near-tie when margin < NEAR_TIE)."""
    if got == want:
        return None
    k = next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)
    row = ref_dec.logits(ids + want[:k])[-1]
    return k, abs(float(row[want[k]]) - float(row[got[k]]))


def run_checking_state(ctx, ar_ctx, full: list[int]) -> tuple[list[int], set[int]]:
    """Runs ctx's begun generation to the end.  After every step: exactly one target forward ran (also on
    rejection) and the committed state equals, byte for byte, that of ar_ctx after a plain forward over
    full[:n_past].  Returns (tokens, accepted-draft counts seen)."""
    out, accepted = [], set()
    fwd = ctx.n_forwards
    while True:
        toks = ctx.generate_next()
        if not toks:
            break
        out += toks
        steps = ctx.step_stats()
        if not steps:
            continue  # the prefill's token
        st = steps[-1]
        accepted.add(st["accepted"])
        assert st["target_forwards"] == 1 and ctx.n_forwards == fwd + 1
        fwd = ctx.n_forwards
        ar_ctx.reset()
        ar_ctx.forward(full[: ctx.n_past], logit_rows=[])
        assert ctx.state() == ar_ctx.state(), f"state differs after a step accepting {st['accepted']}"
    return out, accepted


# A verified tree after a 4-token prefix:   0 -> 1 -> 4 -> 7
#                                             \-> 2 -> 3 -> 5 -> 6
TREE_PREFIX = [7, 8, 9, 10]
TREE_TOKENS = [50, 60, 61, 70, 71, 80, 90, 72]
TREE_PARENT = [-1, 0, 0, 2, 1, 3, 5, 4]


def commit_and_chain_states(ctx, path: list[int]) -> tuple[bytes, bytes]:
    """The committed state after verifying the tree above and committing `path`, and after a chain of the
    same tokens (prefix in one forward, the path's tokens in another: on CUDA, batches of <= 8 run the
    per-token matvec as the tree did).  Commit is exact when the two are equal."""
    depth: list[int] = []
    for p in TREE_PARENT:
        depth.append(0 if p < 0 else depth[p] + 1)
    ctx.reset()
    ctx.forward(TREE_PREFIX)
    ctx.forward(TREE_TOKENS, pos=[len(TREE_PREFIX) + d for d in depth], parent=TREE_PARENT, commit=False)
    ctx.commit_path(path)
    got = ctx.state()
    ctx.reset()
    ctx.forward(TREE_PREFIX)
    ctx.forward([TREE_TOKENS[i] for i in path])
    return got, ctx.state()
