"""Chain speculative decoding: output equal to AR greedy, commit by gather, one target forward per step.

Drafts come from a random drafter (acceptance ~0), from the hook (teacher-forced from an AR run and
corrupted at a chosen index, so every accept length 0..B-1 occurs), and from a drafter distilled on the
tiny target (tests/fixtures, high acceptance).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder
from dflash27b._lib import DFlashError
from spec_steps import run_checking_state
from tiny_draft import make_tiny_draft

N_NEW = 256
DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("rdraft"), n_layers=2, block_size=16, seed=5)


def prompt_of(n: int) -> list[int]:
    return [(7 + 31 * i) % 2000 for i in range(n)]


@pytest.fixture(scope="module")
def ar_reference(ar_tokens):
    return lambda n_prompt, kv: ar_tokens(prompt_of(n_prompt), kv, N_NEW)


@pytest.mark.parametrize("kv", ["f32", "q4_0"])
@pytest.mark.parametrize("n_prompt", [1, 17, pytest.param(300, marks=pytest.mark.slow)])
@pytest.mark.parametrize("block", [4, 8, 16])
def test_chain_equals_ar_random_drafter(tiny_f32_gguf, random_draft, ar_reference, kv, n_prompt, block):
    with Decoder(tiny_f32_gguf, random_draft, kv_type=kv, ctx=1024, threads=2) as d:
        r = d.generate(prompt_of(n_prompt), N_NEW, ignore_eos=True, mode="chain", block_size=block)
    assert r.stats.mode == "chain" and r.stats.block_size == block
    assert r.tokens == ar_reference(n_prompt, kv)
    assert sum(r.stats.accept_lengths) + 1 == N_NEW
    assert all(1 <= a <= block for a in r.stats.accept_lengths)
    assert r.stats.target_forwards == [1] * r.stats.steps


@pytest.mark.parametrize("kv", ["f32", "q4_0"])
@pytest.mark.parametrize("block", [4, 8, 16])
def test_chain_equals_ar_distilled_drafter(tiny_f32_gguf, kv, block):
    """A prompt the fixture drafter was distilled on: most steps accept several drafts."""
    prompt = np.random.default_rng(0).integers(0, 2047, 16).tolist()
    with Decoder(tiny_f32_gguf, kv_type=kv, ctx=1024, threads=2) as d:
        want = d.generate(prompt, N_NEW, ignore_eos=True).tokens
    with Decoder(tiny_f32_gguf, DISTILLED, kv_type=kv, ctx=1024, threads=2) as d:
        r = d.generate(prompt, N_NEW, ignore_eos=True, mode="chain", block_size=block)
    assert r.tokens == want
    # It learned the first 96 tokens of the f32-KV continuation, so most of those come as accepted
    # drafts; Q4_0 KV makes the (chaotic) target continue differently after a few tokens.
    drafts_accepted = sum(a - 1 for a in r.stats.accept_lengths)
    assert drafts_accepted >= (60 if kv == "f32" else 2)


def teacher(full: list[int], block: int, vocab: int):
    """A hook proposing the reference continuation, corrupted so step i accepts exactly i % block drafts."""
    seen = []

    def hook(root_pos: int, root_token: int, n: int) -> list[int]:
        assert full[root_pos] == root_token  # the root is the reference token at its position
        want = len(seen) % block
        seen.append(want)
        drafts = list(full[root_pos + 1: root_pos + 1 + n])
        assert len(drafts) == n
        if want < n:
            drafts[want] = (drafts[want] + 1) % vocab
        return drafts

    return hook, seen


@pytest.mark.parametrize("kv", ["f32", "q4_0"])
@pytest.mark.parametrize("block", [4, 8])
def test_injected_drafts_every_accept_length_state_equals_ar(tiny_f32_gguf, ar_reference, kv, block):
    n_prompt, n_new = 17, 96
    ref = ar_reference(n_prompt, kv)[:n_new]
    full = prompt_of(n_prompt) + ref
    with Decoder(tiny_f32_gguf, kv_type=kv, ctx=512, threads=2) as ar, \
            Decoder(tiny_f32_gguf, kv_type=kv, ctx=512, threads=2) as sp:
        hook, _ = teacher(full, block, 2048)
        ctx = sp.context
        ctx.set_draft_hook(hook)
        ctx.generate_begin(prompt_of(n_prompt), n_new, True, [], mode=1, block_size=block)
        out, accepted = run_checking_state(ctx, ar.context, full)
        assert out == ref
        assert accepted == set(range(block))


def test_small_ring_still_equals_ar_and_draft_memory_is_constant(tiny_f32_gguf, random_draft, ar_reference):
    with Decoder(tiny_f32_gguf, random_draft, kv_type="f32", ctx=1024, threads=2, feature_ring=64) as d:
        r = d.generate(prompt_of(300), N_NEW, ignore_eos=True, mode="chain", block_size=8)
        small = d.context.draft_state_bytes
    assert r.tokens == ar_reference(300, "f32")
    sizes = set()
    for ctx in (512, 4096):
        with Decoder(tiny_f32_gguf, random_draft, kv_type="f32", ctx=ctx, threads=2, feature_ring=64) as d:
            d.generate(prompt_of(300 if ctx > 400 else 17), 8, ignore_eos=True)
            sizes.add(d.context.draft_state_bytes)
    assert sizes == {small}  # independent of context length and prompt length
    # ring of 64 positions x (2 layer features x 256) f32 + 2 layers x K,V x (64 + the block's 8 slots) x 128 f32
    block = max(8, json.loads((Path(random_draft) / "config.json").read_text())["block_size"])
    assert small == 64 * 512 * 4 + 2 * 2 * (64 + block) * 128 * 4


def test_mode_errors(tiny_f32_gguf, random_draft):
    with Decoder(tiny_f32_gguf, threads=1) as d:
        with pytest.raises(DFlashError, match="needs a drafter"):
            d.generate([1, 2, 3], 4, mode="chain")
        with pytest.raises(DFlashError, match="unknown mode"):
            d.generate([1, 2, 3], 4, mode="tree")
    with Decoder(tiny_f32_gguf, random_draft, threads=1, batch=8) as d:
        with pytest.raises(DFlashError, match="exceeds the context's batch size"):
            d.generate([1, 2, 3], 4, mode="chain", block_size=16)
        r = d.generate([1, 2, 3], 4, mode="ar")
        assert r.stats.mode == "ar" and r.stats.accept_lengths == [1, 1, 1]


def test_chain_near_context_end(tiny_f32_gguf, random_draft):
    """The verify block shrinks to the room left; the stop reason says the context is full."""
    with Decoder(tiny_f32_gguf, random_draft, kv_type="f32", ctx=40, threads=2) as d:
        r = d.generate(prompt_of(30), 64, ignore_eos=True, mode="chain", block_size=8)
        a = d.generate(prompt_of(30), 64, ignore_eos=True, mode="ar")
    assert r.stats.stop_reason == a.stats.stop_reason == "context_full"
    assert r.tokens == a.tokens
