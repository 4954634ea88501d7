"""The prefix cache: a later prompt that starts like an earlier one prefills only what is new, and decodes
exactly as a cold start would (`==`, greedy and seeded sampling, every mode).

Scenarios, each against a Decoder without a cache:
  * extension: turn 2 = turn 1's prompt + its reply + new tokens (a chat's next turn);
  * divergence in the middle: a prompt sharing only the first ~150 tokens (a checkpoint every 64 here);
  * an edit inside the last checkpoint interval: turn 1's prompt with its last tokens changed.
Also: cache_prompt / cache=False bypasses it, memory stays within the budget over 200 conversations, and
through the daemon turn 2 of a 1,500-token conversation reaches its first token in <= 25% of turn 1's time.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dflash27b import Decoder
from dflash27b.prefix_cache import PrefixCache

MODES = ["ar", "chain", "ddtree", "auto"]
SAMPLING = [{}, {"temperature": 0.8, "seed": 5}]


@pytest.fixture(scope="module")
def history(pair):
    with Decoder(pair[0], device="cpu", threads=1) as d:
        src = open(os.path.join(os.path.dirname(__file__), "..", "python", "dflash27b", "decoder.py")).read()
        return d.tokenize(src)[:1600]


@pytest.fixture(scope="module")
def cold(pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=2048, batch=64) as d:
        yield d


@pytest.fixture()
def warm(pair):
    with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=2048, batch=64, cache_mem=64 << 20) as d:
        yield d


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_cached_continuations_equal_cold_decodes(warm, cold, history, mode, sampling):
    kw = dict(ignore_eos=True, mode=mode, **sampling)
    p1 = history[:300]
    r1 = warm.generate(p1, 24, **kw)
    assert r1.tokens == cold.generate(p1, 24, **kw).tokens and r1.stats.cached_tokens == 0
    cases = {
        "extension": (p1 + r1.tokens + history[400:424], len(p1) + len(r1.tokens) - 1),
        "divergence": (history[:150] + history[900:1000], 128),
        "edit in the last interval": (p1[:-3] + history[1000:1003], 256),
    }
    for name, (prompt, want_cached) in cases.items():
        r = warm.generate(prompt, 24, **kw)
        assert r.tokens == cold.generate(prompt, 24, **kw).tokens, name
        assert r.stats.cached_tokens >= want_cached if name == "extension" else r.stats.cached_tokens == want_cached, \
            (name, r.stats.cached_tokens)


def test_bypass_and_identical_prompt(warm, cold, history):
    p = history[:200]
    warm.generate(p, 8, ignore_eos=True, mode="ar")
    r = warm.generate(p, 8, ignore_eos=True, mode="ar", cache=False)
    assert r.stats.cached_tokens == 0
    before = warm.prefix_cache.stats()["checkpoints"]
    warm.generate(history[300:500], 8, ignore_eos=True, mode="ar", cache=False)
    assert warm.prefix_cache.stats()["checkpoints"] == before  # a bypass feeds nothing either
    again = warm.generate(p, 8, ignore_eos=True, mode="ar")  # the same prompt: all but its last token reused
    assert again.stats.cached_tokens == 192  # the checkpoint at 192 (every 64); the one at 200 leaves nothing
    assert again.tokens == cold.generate(p, 8, ignore_eos=True, mode="ar").tokens


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_chat_turns_reuse_the_history_the_template_drops_thinking_from(warm, cold, mode):
    """Qwen3.5's template drops an earlier turn's thinking (and the generation prompt's <think>) from later
    prompts, so turn 1's prompt + reply is never a prefix of turn 2.  The history before the generation prompt
    is: a checkpoint there is reused by the next turn, and each reply equals a cold decode."""
    msgs = [{"role": "system", "content": "You write Python. " * 20}, {"role": "user", "content": "A stack."}]
    kw = dict(chat=True, ignore_eos=True, mode=mode)
    r1 = warm.generate(msgs, 16, **kw)
    assert r1.tokens == cold.generate(msgs, 16, **kw).tokens
    history = warm.history_len(msgs, r1.prompt_tokens)
    assert 0 < history < len(r1.prompt_tokens)
    turn2 = msgs + [{"role": "assistant", "content": "class Stack: pass", "reasoning_content": r1.text},
                    {"role": "user", "content": "Now a queue."}]
    r2 = warm.generate(turn2, 16, **kw)
    assert r2.tokens == cold.generate(turn2, 16, **kw).tokens
    assert r2.stats.cached_tokens == history      # all of turn 1's history, none of its generation prompt
    assert warm.tokenize(warm.chat_prompt(turn2))[:history] == r1.prompt_tokens[:history]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_stays_within_the_budget(pair, history):
    budget = 4 << 20
    with Decoder(pair[0], device="cpu", threads=2, ctx=2048, batch=64, cache_mem=budget) as d:
        pc = d.prefix_cache
        d.generate(history[:64], 4, ignore_eos=True, mode="ar")
        rss0 = _rss()
        peak = 0
        for i in range(200):  # 200 distinct conversations of ~200-400 tokens
            start = (i * 37) % 1200
            d.generate(history[start:start + 200 + i % 200], 8, ignore_eos=True, mode="ar")
            peak = max(peak, pc.bytes)
            assert pc.bytes <= budget
        grown = _rss() - rss0
    assert pc.evicted > 0 and pc.count > 0 and peak > budget // 2
    assert grown < budget + (32 << 20), grown  # the cache's bytes plus allocator slack, not 200 conversations


def test_prefix_cache_unit(history):
    """Trie bookkeeping alone (a fake context)."""
    class Ctx:
        def get_kv(self, p0, p1):
            return bytes(p1 - p0)

        def get_recurrent(self):
            return b"r" * 100

    pc = PrefixCache(10_000, every=64)
    a = pc.save(Ctx(), history[:100])
    b = pc.save(Ctx(), history[:180])
    c = pc.save(Ctx(), history[:50])  # saved later, shorter: a sibling of a under the root
    assert b.parent is a and c.parent is pc.root and pc.count == 3
    assert pc.lookup(history[:181]) is b and pc.lookup(history[:180]) is a  # leaves >= 1 token to prefill
    assert pc.lookup(history[:51]) is c and pc.lookup(history[1:60]) is None
    assert pc.save(Ctx(), history[:100]) is a and pc.count == 3


def test_daemon_turn_two_reaches_its_first_token_in_a_quarter_of_the_time(pair, history, tmp_path):
    """Acceptance: the tiny pair on the daemon, turn 1 = a 1,500-token history; turn 2 = turn 1 + its reply
    + 24 new tokens; time to the first token event, each reply equal to a cold decode."""
    from test_daemon import _wait_socket

    sock = str(tmp_path / "d.sock")
    proc = subprocess.Popen([sys.executable, "-m", "dflash27b.cli", "serve", "--socket", sock, "-c", "4096",
                             "-t", "2", "--cache-mem", "0.25"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_socket(sock, proc)
        remote = Decoder.connect(sock)

        def ttft(prompt):
            t0 = time.perf_counter()
            first = None
            tokens = []
            for ev in remote.events(prompt, 32, ignore_eos=True, stream=True):
                if ev["event"] == "token" and ev["ids"] and first is None:
                    first = time.perf_counter() - t0
                if ev["event"] == "done":
                    tokens = ev["tokens"]
                    stats = ev["stats"]
            return first, tokens, stats

        t1, reply, s1 = ttft(history[:1500])
        turn2 = history[:1500] + reply + history[1500:1524]
        t2, reply2, s2 = ttft(turn2)
        with Decoder(pair[0], pair[1], device="cpu", threads=2, ctx=4096) as cold:
            assert reply == cold.generate(history[:1500], 32, ignore_eos=True).tokens
            assert reply2 == cold.generate(turn2, 32, ignore_eos=True).tokens
        assert s1["cached_tokens"] == 0 and s2["cached_tokens"] >= 1500 + len(reply) - 1
        assert t2 <= 0.25 * t1, (t1, t2)
        health = remote.health()["cache"]
        assert health["hits"] >= 1 and 0 < health["bytes"] <= health["max_bytes"] == int(0.25 * 2**30)
    finally:
        try:
            Decoder.connect(sock).shutdown()
        except Exception:  # noqa: BLE001
            pass
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
