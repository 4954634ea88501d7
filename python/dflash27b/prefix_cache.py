"""A prefix cache: checkpoints of earlier decodes' states, reused by later prompts that start the same way.

A chat client sends the whole conversation every turn; without a cache every turn prefills all of it again.
The target is hybrid: its attention layers' KV rows can be cut at any position, but the delta-net layers'
recurrent state exists only at the positions where it was saved.  So a checkpoint at position n holds

  * the tokens [parent.n, n) and the KV rows of those positions (its ancestors hold the rows before), and
  * every delta-net layer's conv window + recurrent state at n,

in a trie of token spans.  A prompt reuses the deepest checkpoint whose tokens are a prefix of it (and
leave at least one token to prefill, whose logits start the decode), restores rows [0, n) and the state at
n, and prefills the rest.  The forward is batch-invariant (every reduction in a fixed order), so the
continuation equals a cold decode token for token; tests/test_prefix_cache.py checks it with `==`.

Checkpoints are taken at the end of each prompt, at every `every`-token chunk of a long prompt, at the end
of each reply, and for chat messages where the conversation's history ends (before the template's generation
prompt): Qwen3.5's template drops an earlier turn's thinking from later prompts, so there the next turn's
prompt parts from this one's prompt + reply, but not from its history.  Memory is bounded by `max_bytes` with least-recently-used eviction of checkpoints that
no other checkpoint builds on.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class Checkpoint:
    n: int                                  # positions [0, n) are covered
    span: tuple[int, ...]                   # tokens [parent.n, n)
    kv: bytes                               # KV rows of [parent.n, n)
    recurrent: bytes                        # delta-net state at n
    parent: "Checkpoint | None"
    children: list["Checkpoint"] = field(default_factory=list)
    used: int = 0                           # LRU clock

    @property
    def nbytes(self) -> int:
        return len(self.kv) + len(self.recurrent) + 8 * len(self.span) + 200


class PrefixCache:
    def __init__(self, max_bytes: int, every: int = 512):
        if max_bytes < 0:
            raise ValueError(f"cache memory must be >= 0 bytes (got {max_bytes})")
        self.max_bytes = int(max_bytes)
        self.every = max(1, int(every))
        self.root = Checkpoint(0, (), b"", b"", None)
        self.bytes = 0
        self.count = 0
        self.hits = 0
        self.lookups = 0
        self.cached_tokens = 0     # prompt tokens served from the cache, all requests
        self.evicted = 0
        self._clock = itertools.count(1)

    # -- lookup / restore ---------------------------------------------------------------------------------
    def _deepest(self, ids, limit: int) -> Checkpoint:
        """The deepest checkpoint whose tokens are a prefix of ids[:limit]."""
        best, stack = self.root, [self.root]
        while stack:
            node = stack.pop()
            if node.n > best.n:
                best = node
            for ch in node.children:
                if ch.n <= limit and tuple(ids[node.n:ch.n]) == ch.span:
                    stack.append(ch)
        return best

    def lookup(self, ids) -> Checkpoint | None:
        """The checkpoint to restore for prompt ids (at most len(ids) - 1 positions), or None."""
        self.lookups += 1
        ck = self._deepest(ids, len(ids) - 1)
        if ck is self.root:
            return None
        self.hits += 1
        self.cached_tokens += ck.n
        return ck

    def restore(self, ctx, ck: Checkpoint) -> int:
        """Puts the context in the state it had at ck.n; returns ck.n."""
        chain = []
        node = ck
        while node is not self.root:
            chain.append(node)
            node = node.parent
        t = next(self._clock)
        for node in reversed(chain):
            ctx.set_kv(node.parent.n, node.n, node.kv)
            node.used = t
        ctx.set_recurrent(ck.recurrent)
        ctx.set_n_past(ck.n)
        return ck.n

    # -- save ---------------------------------------------------------------------------------------------
    def save(self, ctx, ids) -> Checkpoint | None:
        """A checkpoint of the context's committed state, whose tokens are ids (len(ids) == its n_past)."""
        n = len(ids)
        if n == 0 or self.max_bytes == 0:
            return None
        parent = self._deepest(ids, n)
        if parent.n == n:
            parent.used = next(self._clock)
            return parent
        ck = Checkpoint(n, tuple(ids[parent.n:n]), ctx.get_kv(parent.n, n), ctx.get_recurrent(), parent,
                        used=next(self._clock))
        if ck.nbytes > self.max_bytes:
            return None
        parent.children.append(ck)
        self.bytes += ck.nbytes
        self.count += 1
        t = ck.used
        node = parent
        while node is not self.root:  # its ancestors are in use as long as it is
            node.used = t
            node = node.parent
        self._evict()
        return ck if ck.parent is not None else None

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            leaves = [c for c in self._all() if not c.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda c: c.used)
            victim.parent.children.remove(victim)
            victim.parent = None
            self.bytes -= victim.nbytes
            self.count -= 1
            self.evicted += 1

    def _all(self):
        stack = list(self.root.children)
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)

    def clear(self) -> None:
        self.root.children.clear()
        self.bytes = self.count = 0

    def stats(self) -> dict:
        return {"bytes": self.bytes, "max_bytes": self.max_bytes, "checkpoints": self.count, "lookups": self.lookups,
                "hits": self.hits, "cached_tokens": self.cached_tokens, "evicted": self.evicted}
