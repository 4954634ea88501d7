"""An MTP head as llama.cpp's own converter writes it, against transformers.

A tiny Qwen3.5 checkpoint (tests/tiny_hf.py) gains HF's `mtp.*` tensors (`mtp_num_hidden_layers: 1`: fc,
pre_fc_norm_embedding / pre_fc_norm_hidden, norm, and a full-attention layer under mtp.layers.0, its norms
zero-centred as HF stores them) and is converted by llama.cpp's convert_hf_to_gguf.py (F32, with its own
gguf-py; the test tokenizer's pre-tokenizer hash mapped to qwen35, which the converter cannot know).  The
reference is built from the HF weights with transformers' own modules: the trunk's last hidden state (after
its final norm) from Qwen3_5ForCausalLM, the fusion in torch (Gemma-style (1 + w) norms, [embedding | hidden]
into fc), and the layer + final norm + head as a one-layer Qwen3_5ForCausalLM carrying mtp.layers.0 / mtp.norm.
Our MTP logits on the converted file equal it within 1e-4.

Then the bundled target (its head trained for it) written back as a checkpoint (tests/gguf_to_hf.py) and
converted by llama.cpp: the file equals our converter's tensor for tensor, and a chain decode's per-step
accept lengths equal the plain PyTorch loop's (tests/mtp_ref.py).

Needs llama.cpp's source: DFLASH27B_LLAMACPP_SRC=.../vendor/llama.cpp (from `pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36`, unpacked); skipped without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SRC = os.environ.get("DFLASH27B_LLAMACPP_SRC")
pytestmark = pytest.mark.skipif(not SRC or not Path(SRC, "convert_hf_to_gguf.py").exists(),
                                reason="DFLASH27B_LLAMACPP_SRC (llama.cpp's source with its converter) not set")

RUNNER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
for name in dir(base):
    cls = getattr(base, name)
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import load_file, save_file
    from tiny_hf import make_tiny_hf
    d = make_tiny_hf(tmp_path_factory.mktemp("hf") / "mtp", seed=3)
    cfg = json.loads((d / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    st = load_file(str(d / "model.safetensors"))
    rng = np.random.default_rng(7)
    H = cfg["hidden_size"]
    last = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    for k, v in list(st.items()):
        if k.startswith(f"model.layers.{last}."):
            x = v.copy()
            if x.ndim == 2:
                x = x + (rng.standard_normal(x.shape) * 0.02).astype(np.float32)
            st["mtp.layers.0." + k[len(f"model.layers.{last}."):]] = x
    st["mtp.fc.weight"] = (rng.standard_normal((H, 2 * H)) * 0.05).astype(np.float32)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        st[f"mtp.{n}.weight"] = (rng.standard_normal(H) * 0.05).astype(np.float32)
    save_file(st, str(d / "model.safetensors"))
    return d, llamacpp_convert(d, d.parent / "mtp-f32.gguf")


def llamacpp_convert(hf_dir: Path, out: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (F32, MTP head kept) on a checkpoint directory."""
    runner = out.parent / "run_converter.py"
    runner.write_text(RUNNER)
    r = subprocess.run([sys.executable, str(runner), SRC, str(hf_dir), "--outtype", "f32", "--outfile", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_llamacpp_converted_head_equals_transformers(checkpoint):
    from dflash27b import Decoder
    from dflash27b._lib import load
    d, gguf = checkpoint
    with Decoder(gguf, threads=2, warm_up=False, kv_type="f32") as dec:
        assert dec.info["n_mtp_layers"] == 1
        ids = dec.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")[:20]
        ffi, lib = load()
        got = np.zeros((len(ids), dec.info["n_vocab"]), np.float32)
        arr = np.array(ids, np.int32)
        assert lib.dfl_dev_mtp_logits(dec._ctx.handle, ffi.cast("int32_t*", arr.ctypes.data), len(ids),
                                      ffi.cast("float*", got.ctypes.data)) == 0
    from mtp_ref import TorchMtp
    want = TorchMtp(d).logits(ids)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    with Decoder(gguf, "mtp", threads=2, warm_up=False) as dec:   # and it drafts losslessly
        ar = dec.generate("def f(x):", 24, mode="ar", ignore_eos=True).tokens
        for mode in ("chain", "ddtree"):
            assert dec.generate("def f(x):", 24, mode=mode, ignore_eos=True).tokens == ar


@pytest.fixture(scope="module")
def bundled_llamacpp(tmp_path_factory):
    from gguf_to_hf import export_hf
    from test_mtp_gguf import BUNDLED
    d = export_hf(BUNDLED, tmp_path_factory.mktemp("bundled") / "hf")
    return d, llamacpp_convert(d, d.parent / "llamacpp-f32.gguf")


def test_llamacpp_and_our_converter_write_the_same_head(bundled_llamacpp, tmp_path):
    from gguf import GGUFReader
    from gguf import quants as gq

    from dflash27b.tools.convert import convert_hf_to_gguf
    d, theirs = bundled_llamacpp
    ours = convert_hf_to_gguf(d, tmp_path / "ours.gguf", "f32")
    a, b = ({t.name: t for t in GGUFReader(str(p)).tensors} for p in (theirs, ours))
    assert sorted(a) == sorted(b)
    for n in a:
        x, y = (gq.dequantize(t.data, t.tensor_type) for t in (a[n], b[n]))
        assert x.shape == y.shape, n
        np.testing.assert_allclose(x, y, rtol=2e-7, atol=0, err_msg=n)   # A = -exp(A_log): torch's exp vs numpy's
    keys = lambda p: {k: f.contents() for k, f in GGUFReader(str(p)).fields.items()  # noqa: E731
                      if k.startswith("qwen35.") and "context_length" not in k}
    assert keys(theirs) == keys(ours)


@pytest.mark.parametrize("block", [3, 5])
def test_chain_accept_lengths_equal_the_reference_loop(bundled_llamacpp, block):
    from mtp_ref import TorchMtp

    from dflash27b import Decoder
    d, gguf = bundled_llamacpp
    ref = TorchMtp(d)
    with Decoder(gguf, "mtp", threads=2, warm_up=False, kv_type="f32") as dec:
        for text in ("def fibonacci(n):\n    if n < 2:\n", "import os\nimport sys\n\n\ndef main():\n"):
            ids = dec.tokenize(text)
            r = dec.generate(ids, 32, mode="chain", ignore_eos=True, block_size=block)
            toks, steps = ref.chain_reference(ids, 32, block)
            assert r.tokens == toks and r.stats.accept_lengths == steps
            assert max(steps) == block
