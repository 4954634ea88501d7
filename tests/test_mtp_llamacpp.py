"""An MTP head as llama.cpp's own converter writes it, against transformers.

A tiny Qwen3.5 checkpoint (tests/tiny_hf.py) gains HF's `mtp.*` tensors (`mtp_num_hidden_layers: 1`: fc,
pre_fc_norm_embedding / pre_fc_norm_hidden, norm, and a full-attention layer under mtp.layers.0, its norms
zero-centred as HF stores them) and is converted by llama.cpp's convert_hf_to_gguf.py (F32, with its own
gguf-py; the test tokenizer's pre-tokenizer hash mapped to qwen35, which the converter cannot know).  The
reference is built from the HF weights with transformers' own modules: the trunk's last hidden state (after
its final norm) from Qwen3_5ForCausalLM, the fusion in torch (Gemma-style (1 + w) norms, [embedding | hidden]
into fc), and the layer + final norm + head as a one-layer Qwen3_5ForCausalLM carrying mtp.layers.0 / mtp.norm.
Our MTP logits on the converted file equal it within 1e-4.

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
    out = d.parent / "mtp-f32.gguf"
    runner = d.parent / "run_converter.py"
    runner.write_text(RUNNER)
    r = subprocess.run([sys.executable, str(runner), SRC, str(d), "--outtype", "f32", "--outfile", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return d, out


def _reference(d: Path, ids: list[int]) -> np.ndarray:
    import torch
    from safetensors.numpy import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = json.loads((d / "config.json").read_text())
    st = load_file(str(d / "model.safetensors"))
    trunk = Qwen3_5ForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32).eval()
    t = torch.tensor([ids])
    with torch.no_grad():
        h = trunk.model(input_ids=t).last_hidden_state[0]          # after the trunk's final norm
        e = trunk.model.embed_tokens(t)[0]
        eps = cfg["rms_norm_eps"]

        def norm(x, w):                                            # Qwen3.5's RMSNorm: (1 + w)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + torch.from_numpy(st[w]))
        h_prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
        u = torch.cat([norm(e, "mtp.pre_fc_norm_embedding.weight"), norm(h_prev, "mtp.pre_fc_norm_hidden.weight")], -1)
        u = u @ torch.from_numpy(st["mtp.fc.weight"]).T
        one = dict({k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")},
                   num_hidden_layers=1, layer_types=["full_attention"])
        head = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**one)).to(torch.float32).eval()
        sd = {"model.norm.weight": st["mtp.norm.weight"], "lm_head.weight": st["lm_head.weight"],
              "model.embed_tokens.weight": st["model.embed_tokens.weight"]}
        sd.update({"model.layers.0." + k[len("mtp.layers.0."):]: v for k, v in st.items() if k.startswith("mtp.layers.0.")})
        missing = head.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=False)
        assert not missing.unexpected_keys and all("rotary" in k for k in missing.missing_keys), missing
        return head(inputs_embeds=u[None]).logits[0].numpy()


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
    want = _reference(d, ids)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    with Decoder(gguf, "mtp", threads=2, warm_up=False) as dec:   # and it drafts losslessly
        ar = dec.generate("def f(x):", 24, mode="ar", ignore_eos=True).tokens
        for mode in ("chain", "ddtree"):
            assert dec.generate("def f(x):", 24, mode=mode, ignore_eos=True).tokens == ar
