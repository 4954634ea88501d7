"""Test helper (not a test): drive a speculative generation step by step, checking each commit."""
from __future__ import annotations


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
