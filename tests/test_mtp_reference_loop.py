"""The MTP head through a converter and against transformers, on the bundled target (its head trained for
it, so drafts are often right and accept lengths say something).

The bundled GGUF is written back as a transformers checkpoint with `mtp.*` (tests/gguf_to_hf.py) and
converted again by our converter (dflash27b.tools.convert): every tensor comes back as it was (A_log's
exp aside, an ulp), the head as llama.cpp lays it out; `--no-mtp` drops it.  On that file our MTP logits
equal transformers' modules within 1e-4 and a chain decode's per-step accept lengths equal a plain PyTorch
loop's (tests/mtp_ref.py: no cache, every forward from token 0) step for step.  tests/test_mtp_llamacpp.py
does the same with llama.cpp's own converter."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq
from gguf_to_hf import export_hf
from test_mtp_gguf import BUNDLED

from dflash27b import Decoder
from dflash27b.tools.convert import convert_hf_to_gguf, main

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n", "import os\nimport sys\n\n\ndef main():\n"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return export_hf(BUNDLED, tmp_path_factory.mktemp("bundled-hf"))


@pytest.fixture(scope="module")
def ours(hf_dir):
    return convert_hf_to_gguf(hf_dir, hf_dir.parent / "ours-f32.gguf", "f32")


@pytest.fixture(scope="module")
def ref(hf_dir):
    from mtp_ref import TorchMtp
    return TorchMtp(hf_dir)


def tensors(path) -> dict[str, np.ndarray]:
    return {t.name: gq.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            for t in GGUFReader(str(path)).tensors}


def test_our_converter_writes_the_head_as_llamacpp_lays_it_out(hf_dir, ours):
    assert json.loads((hf_dir / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    want, got = tensors(BUNDLED), tensors(ours)
    assert sorted(got) == sorted(want)
    assert {n for n in got if n.startswith("blk.8.")} >= {f"blk.8.nextn.{k}.weight" for k in
                                                        ("eh_proj", "enorm", "hnorm", "shared_head_norm")}
    for name, w in want.items():
        g = got[name].astype(np.float32)
        if name.endswith("ssm_a"):   # -exp(log(-A)): an ulp
            np.testing.assert_allclose(g, w, rtol=2e-7, err_msg=name)
        else:
            assert np.array_equal(g, w.astype(np.float32)), name
    meta = {k: f.contents() for k, f in GGUFReader(str(ours)).fields.items() if k.startswith("qwen35.")}
    assert meta["qwen35.block_count"] == 9 and meta["qwen35.nextn_predict_layers"] == 1
    assert meta["qwen35.attention.recurrent_layers"] == [True, True, True, False, True, True, True, False, False]


def test_no_mtp_drops_the_head(hf_dir, tmp_path, capsys):
    out = tmp_path / "trunk.gguf"
    main([str(hf_dir), str(out), "--outtype", "f32", "--no-mtp"])
    r = GGUFReader(str(out))
    assert not [t.name for t in r.tensors if t.name.startswith("blk.8.")]
    assert r.fields["qwen35.block_count"].contents() == 8 and "qwen35.nextn_predict_layers" not in r.fields
    with Decoder(out, threads=2, warm_up=False) as d:
        assert d.info["n_mtp_layers"] == 0


def test_head_logits_equal_transformers(ours, ref):
    from dflash27b._lib import load
    with Decoder(ours, threads=2, warm_up=False, kv_type="f32") as dec:
        ids = dec.tokenize(PROMPTS[0] + "        return n\n")
        ffi, lib = load()
        got = np.zeros((len(ids), dec.info["n_vocab"]), np.float32)
        arr = np.array(ids, np.int32)
        assert lib.dfl_dev_mtp_logits(dec._ctx.handle, ffi.cast("int32_t*", arr.ctypes.data), len(ids),
                                      ffi.cast("float*", got.ctypes.data)) == 0
    want = ref.logits(ids)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


@pytest.mark.parametrize("block", [3, 5])
def test_chain_accept_lengths_equal_the_reference_loop(ours, ref, block):
    with Decoder(ours, "mtp", threads=2, warm_up=False, kv_type="f32") as dec:
        for text in PROMPTS:
            ids = dec.tokenize(text)
            r = dec.generate(ids, 32, mode="chain", ignore_eos=True, block_size=block)
            toks, steps = ref.chain_reference(ids, 32, block)
            assert r.tokens == toks
            assert r.stats.accept_lengths == steps
            assert max(steps) == block          # the trained head's drafts are accepted whole at times
