"""Qwen3.5 / 3.6 / 3.8 GGUFs with the model's MTP head (llama.cpp's "-MTP" files: qwen35.nextn_predict_layers = 1,
block_count counting the head's layer, blk.N.* and blk.N.nextn.* tensors for it; docs/research/dflash2-spec.md §7)
load as their trunk: the same layers, the same tokens as the file without the head.  (Drafting with the head
is issue 43.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

BUNDLED = Path(__file__).resolve().parent.parent / "python" / "dflash27b" / "models" / "tiny-target.gguf"


def copy_with_mtp(src, dst):
    """src's KVs and tensors, plus a qwen35 MTP head as llama.cpp writes one: nextn_predict_layers = 1, block_count + 1,
    and blk.N.* (a full-attention block) + blk.N.nextn.* tensors for the extra layer N."""
    r = GGUFReader(src)
    n = int(r.fields["qwen35.block_count"].contents())
    w = GGUFWriter(dst, arch="qwen35")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = f.contents()
        if name == "qwen35.block_count":
            val = n + 1
        t = f.types[0]
        sub = f.types[-1] if t == VT.ARRAY else None
        w.add_key_value(name, val, t, sub_type=sub)
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    H = int(r.fields["qwen35.embedding_length"].contents())
    rng = np.random.default_rng(0)
    for t in r.tensors:  # the extra block: a copy of the last full-attention block's tensors
        if t.name.startswith(f"blk.{n - 1}."):
            w.add_tensor(t.name.replace(f"blk.{n - 1}.", f"blk.{n}."), np.asarray(t.data),
                         raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    for nm, shape in (("eh_proj.weight", (H, 2 * H)), ("enorm.weight", (H,)), ("hnorm.weight", (H,)),
                      ("shared_head_norm.weight", (H,))):
        w.add_tensor(f"blk.{n}.nextn.{nm}", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_with_an_mtp_head_loads_as_its_trunk(tmp_path):
    from dflash27b import Decoder
    mtp = tmp_path / "tiny-mtp.gguf"
    copy_with_mtp(str(BUNDLED), str(mtp))
    assert GGUFReader(str(mtp)).fields["qwen35.nextn_predict_layers"].contents() == 1
    with Decoder(BUNDLED, threads=2) as a, Decoder(mtp, threads=2) as b:
        assert a.info["n_layer"] == b.info["n_layer"] == 8
        want = a.generate("def f(x):", 16, mode="ar", ignore_eos=True).tokens
        assert b.generate("def f(x):", 16, mode="ar", ignore_eos=True).tokens == want
