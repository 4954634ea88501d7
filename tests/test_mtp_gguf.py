"""Qwen3.5 / 3.6 / 3.8 GGUFs with the model's MTP head (llama.cpp's "-MTP" files: qwen35.nextn_predict_layers = 1,
block_count counting the head's layer, blk.N.* and blk.N.nextn.* tensors for it; docs/research/dflash2-spec.md §7)
load as their trunk: the same layers, the same tokens as the file without the head.  (Drafting with the head
is issue 43.)"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

BUNDLED = Path(__file__).resolve().parent.parent / "python" / "dflash27b" / "models" / "tiny-target.gguf"


def _copy(src, dst, head: bool, keep: bool = False, f32: bool = False):
    """src's trunk (any MTP head it has left out unless keep), plus with head=True a qwen35 MTP head as llama.cpp
    writes one: nextn_predict_layers = 1, block_count + 1, and blk.N.* (a full-attention block: a copy of the
    last one) + random blk.N.nextn.* tensors for the extra layer N.  f32: every tensor dequantised to F32."""
    from gguf import quants as gq
    r = GGUFReader(src)
    if keep:
        w = GGUFWriter(dst, arch="qwen35")
        for name, f in r.fields.items():
            if not name.startswith("GGUF.") and name != "general.architecture":
                t = f.types[0]
                w.add_key_value(name, f.contents(), t, sub_type=f.types[-1] if t == VT.ARRAY else None)
        for t in r.tensors:
            shape = tuple(int(v) for v in reversed(t.shape))
            if f32:
                w.add_tensor(t.name, gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32))
            else:
                w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(shape), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return
    old = int(r.fields["qwen35.nextn_predict_layers"].contents()) if "qwen35.nextn_predict_layers" in r.fields else 0
    n = int(r.fields["qwen35.block_count"].contents()) - old
    w = GGUFWriter(dst, arch="qwen35")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "qwen35.nextn_predict_layers"):
            continue
        val = f.contents()
        if name == "qwen35.block_count":
            val = n + (1 if head else 0)
        if name == "qwen35.attention.recurrent_layers":
            val = list(val)[:n] + ([False] if head else [])
        t = f.types[0]
        sub = f.types[-1] if t == VT.ARRAY else None
        w.add_key_value(name, val, t, sub_type=sub)
    if head:
        w.add_uint32("qwen35.nextn_predict_layers", 1)
    trunk = [t for t in r.tensors if not t.name.startswith(f"blk.{n}.")]
    for t in trunk:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    if head:
        H = int(r.fields["qwen35.embedding_length"].contents())
        rng = np.random.default_rng(0)
        for t in trunk:  # the extra block: a copy of the last full-attention block's tensors
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


def copy_with_mtp(src, dst):
    """src's trunk with a random MTP head (tests/test_mtp.py: the engine's exactness needs no trained head)."""
    _copy(src, dst, head=True)


def trunk_only(src, dst):
    """src without its MTP head, as llama.cpp's converter writes a model with --no-mtp."""
    _copy(src, dst, head=False)


def as_f32(src, dst):
    """src as it is, every tensor dequantised to F32 (references compare in float64 against F32 files)."""
    _copy(src, dst, head=False, keep=True, f32=True)


def test_a_gguf_with_an_mtp_head_loads_as_its_trunk(tmp_path):
    from dflash27b import Decoder
    mtp = tmp_path / "tiny-mtp.gguf"
    copy_with_mtp(str(BUNDLED), str(mtp))
    trunk = tmp_path / "tiny-trunk.gguf"
    trunk_only(str(BUNDLED), str(trunk))
    assert GGUFReader(str(mtp)).fields["qwen35.nextn_predict_layers"].contents() == 1
    assert "qwen35.nextn_predict_layers" not in GGUFReader(str(trunk)).fields
    with Decoder(trunk, threads=2) as a, Decoder(mtp, threads=2) as b, Decoder(BUNDLED, threads=2) as c:
        assert c.info["n_layer"] == 8
        assert a.info["n_layer"] == b.info["n_layer"] == 8
        want = a.generate("def f(x):", 16, mode="ar", ignore_eos=True).tokens
        assert b.generate("def f(x):", 16, mode="ar", ignore_eos=True).tokens == want
        assert c.generate("def f(x):", 16, mode="ar", ignore_eos=True).tokens == want


def head_only(src, dst):
    """The MTP head alone, as ggml-org ships mtp-*.gguf next to a trunk converted with --no-mtp: src's KVs, the
    head's layer (blk.N.* and blk.N.nextn.*), the embeddings, output and output norm; no trunk layer."""
    r = GGUFReader(src)
    n = int(r.fields["qwen35.block_count"].contents()) - 1
    w = GGUFWriter(dst, arch="qwen35")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = f.types[0]
        w.add_key_value(name, f.contents(), t, sub_type=f.types[-1] if t == VT.ARRAY else None)
    for t in r.tensors:
        if t.name.startswith(f"blk.{n}.") or t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())),
                         raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_dflash2_drafter_fits_a_target_with_its_mtp_head_and_a_head_alone_is_refused(tmp_path):
    """A Qwen3.8-style file carrying its MTP head takes a DFlash2 drafter for its trunk (target_layer_ids index
    the trunk: chain and DDTree == AR); the head shipped alone is refused as what it is."""
    import pytest

    from dflash27b import Decoder, DFlashError
    from tiny_draft import to_dflash2
    mtp = tmp_path / "tiny-mtp.gguf"
    copy_with_mtp(str(BUNDLED), str(mtp))
    d2 = to_dflash2(BUNDLED.parent / "tiny-draft", tmp_path / "d2", scale=0.02, seed=1, dtype="bf16")
    with Decoder(mtp, d2, threads=2) as d:
        ar = d.generate("def f(x):", 24, mode="ar", ignore_eos=True).tokens
        for mode in ("chain", "ddtree"):
            assert d.generate("def f(x):", 24, mode=mode, ignore_eos=True).tokens == ar, mode
    head = tmp_path / "mtp-tiny.gguf"
    head_only(str(mtp), str(head))
    with pytest.raises(DFlashError, match=r"holds only the model's MTP head \(blk\.8\.nextn\.\*\), not the model"):
        Decoder(head, threads=2)
