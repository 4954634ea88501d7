"""The tiny pair shipped inside the package (python/dflash27b/models): a qwen35 target trained on Python
standard-library sources and a DFlash drafter distilled on it (models/train/).  These tests hold the pair
to what it is for: it writes Python, the drafter predicts it on prompts it never saw, the drafter is
z-lab's format to the digit, and the CLI runs it with no model arguments from any directory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash27b import Decoder
from dflash27b.decoder import bundled_pair

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "models" / "heldout_prompts.jsonl"

pytestmark = pytest.mark.skipif(bundled_pair() is None, reason="this install has no bundled pair")


def _heldout() -> list[str]:
    return [json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def dec():
    with Decoder(threads=2) as d:
        yield d


def test_default_decoder_is_the_pair_with_auto(dec):
    t, d = bundled_pair()
    assert dec.target == str(t) and dec.draft == str(d) and dec.default_mode == "auto"
    assert t.stat().st_size + sum(f.stat().st_size for f in d.iterdir()) < 30e6


def test_writes_python(dec):
    """On held-out function headers the target writes an indented body (docstring, return, assignments,
    calls) — a 9 M-parameter model's Python, repetitive but recognisable."""
    outs = []
    for p in _heldout():
        text = dec.generate(p, 48, mode="ar").text
        indent = len(p.splitlines()[-1]) - len(p.splitlines()[-1].lstrip()) + 4
        outs.append(text)
        assert text.startswith(" " * indent) and not text.startswith(" " * (indent + 1)), (p, text)
        assert all(ch.isprintable() or ch in "\n\t" for ch in text), text
    pythonic = [t for t in outs if any(k in t for k in ('"""', "return ", "self.", " = ", "if "))]
    assert len(pythonic) >= 8, outs


@pytest.mark.parametrize("mode,kw,floor", [("chain", dict(block_size=16), 3.0), ("ddtree", dict(budget=22), 3.5)])
def test_acceptance_on_heldout_prompts(dec, mode, kw, floor):
    """Mean accept length (z-lab's: tokens per step incl. the bonus) over 128 new tokens on each of 10
    held-out stdlib prompts, and the speculative output is the target's own greedy output token for token."""
    acc = []
    for p in _heldout():
        ar = dec.generate(p, 128, ignore_eos=True, mode="ar").tokens
        r = dec.generate(p, 128, ignore_eos=True, mode=mode, **kw)
        assert r.tokens == ar
        acc += r.stats.accept_lengths
    mean = sum(acc) / len(acc)
    print(f"{mode}: mean accept {mean:.2f} over {len(acc)} steps")
    assert mean >= floor


@pytest.mark.oracle
@pytest.mark.parametrize("which", ["tiny-draft2", "tiny-draft"])
def test_zlab_loads_the_bundled_drafter(dec, which):
    """z-lab's dflash package loads each shipped drafter (the default DFlash2 one, and the DFlash one) and its
    first-block logits match ours."""
    torch = pytest.importorskip("torch")
    zl = pytest.importorskip("dflash.model")
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from dflash27b import _handles
    t, _ = bundled_pair()
    d = t.parent / which
    r = GGUFReader(str(t))
    tensors = {x.name: x for x in r.tensors}

    def f32(name):
        x = tensors[name]
        return torch.from_numpy(dequantize(x.data, x.tensor_type).reshape(int(x.shape[1]), int(x.shape[0])).copy())

    class Target(torch.nn.Module):  # what z-lab's helpers ask of a target: input embeddings and lm_head
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding.from_pretrained(f32("token_embd.weight"))
            self.lm_head = torch.nn.Linear(self.embed.weight.shape[1], self.embed.weight.shape[0], bias=False)
            self.lm_head.weight.data = f32("output.weight")

        def get_input_embeddings(self):
            return self.embed

    cls = zl.DFlash2DraftModel if which == "tiny-draft2" else zl.DFlashDraftModel
    model = cls.from_pretrained(str(d), dtype=torch.float32).eval()
    tgt = Target()
    prompt = dec.tokenize(_heldout()[0])
    ids = model.config.dflash_config["target_layer_ids"]
    feats = dec.hidden_states(prompt, ids).reshape(len(prompt), -1)
    root = dec.generate(prompt, 1, mode="ar").tokens[0]
    B, mask = model.config.block_size, model.config.dflash_config["mask_token_id"]
    block = torch.tensor([[root] + [mask] * (B - 1)])
    with torch.inference_mode():
        h = model(target_hidden=torch.from_numpy(feats)[None], noise_embedding=zl._raw_input_embeddings(tgt, block),
                  position_ids=torch.arange(0, len(prompt) + B)[None], past_key_values=zl._make_cache(model.config),
                  use_cache=True)
        want = model.compute_logits(h[:, 1:], zl._output_head(tgt))[0].numpy()
    draft = _handles.Draft(str(d), _handles.Model(str(t)))
    dr = _handles.Drafter(draft, _handles.Model(str(t)), ring_capacity=4096, n_threads=2)
    dr.push_features(feats)
    got = dr.propose(block[0].tolist())
    err = np.abs(got - want).max()
    print(f"first-block draft logits: max |ours - z-lab| = {err:.2e} (|logit| up to {np.abs(want).max():.1f})")
    assert err < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_cli_runs_the_pair_from_any_directory(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "def fibonacci(n):", "-n", "32",
                        "--compare", "-t", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "[auto cpu]" in r.stderr and "auto: " in r.stderr and "AR + " in r.stderr and "tok/s" in r.stderr
    assert "speedup" in r.stderr and "same tokens: True" in r.stderr
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "def fibonacci(n):", "-n", "32", "--json",
                        "-t", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    s = json.loads(r.stdout)["stats"]
    assert s["mode"] == "auto" and s["mean_accept"] >= 1.0 and s["generated_tokens"] == 32
    assert len(s["auto_budget"]) == len(s["accept_lengths"]) and all(b >= 0 for b in s["auto_budget"])
