"""Bad input gets a one-line error naming the problem: through Python as
DFlashError, through the CLI as `error: ...` with exit status 1; never a crash."""
import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from dflash27b import Decoder, DFlashError


@pytest.fixture(scope="module")
def good(synth_gguf):
    return synth_gguf("f32")


def rewrite(src, dst, *, drop_key=None, set_kv=None, drop_tensor=None, arch=None, alignment=None, extra_kv=()):
    """Copy a GGUF with gguf-py, changing one thing."""
    r = GGUFReader(src)
    w = GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    if alignment:
        w.add_custom_alignment(alignment)
    for name, val, vt, sub in extra_kv:
        w.add_key_value(name, val, vt, sub_type=sub)
    set_kv = set_kv or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment", drop_key):
            continue
        vt = f.types[0]
        val = set_kv.get(name, f.contents())
        sub = f.types[1] if vt == GGUFValueType.ARRAY else None
        w.add_key_value(name, val, vt, sub_type=sub)
    for t in r.tensors:
        if t.name != drop_tensor:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def tensor_info_pos(path, name):
    """Byte offsets of (type, offset) fields of a tensor's info record."""
    r = GGUFReader(path)
    t = next(t for t in r.tensors if t.name == name)
    start = t.field.offset
    type_pos = start + 8 + len(name.encode()) + 4 + 8 * len(t.shape)
    return type_pos, type_pos + 4


def patched(good, tmp_path, fn):
    data = bytearray(good.read_bytes())
    fn(data)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data))
    return p


CASES = {
    "magic": (lambda g, d: patched(g, d, lambda b: b.__setitem__(slice(0, 4), b"GGML")), r"not a GGUF file"),
    "version": (lambda g, d: patched(g, d, lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 1))),
                r"unsupported GGUF version 1"),
    "truncated_header": (lambda g, d: patched(g, d, lambda b: b.__delitem__(slice(300, None))),
                         r"truncated GGUF file"),
    "truncated_data": (lambda g, d: patched(g, d, lambda b: b.__delitem__(slice(len(b) - 1000, None))),
                       r"beyond the end of the file .* the file is truncated"),
    "tensor_out_of_bounds": (lambda g, d: patched(g, d, lambda b: b.__setitem__(
        slice(tensor_info_pos(g, "blk.2.ffn_up.weight")[1], tensor_info_pos(g, "blk.2.ffn_up.weight")[1] + 8),
        struct.pack("<Q", 1 << 36))), r"tensor 'blk.2.ffn_up.weight' data starts at offset 68719476736 .* damaged"),
    "unknown_type": (lambda g, d: patched(g, d, lambda b: b.__setitem__(
        slice(tensor_info_pos(g, "blk.0.ffn_up.weight")[0], tensor_info_pos(g, "blk.0.ffn_up.weight")[0] + 4),
        struct.pack("<I", 3))), r"tensor 'blk.0.ffn_up.weight' has unsupported tensor type 3 \(Q4_1\)"),
    "missing_key": (lambda g, d: rewrite(g, d / "k.gguf", drop_key="qwen35.embedding_length"),
                    r"missing metadata key 'qwen35.embedding_length'"),
    "missing_tensor": (lambda g, d: rewrite(g, d / "t.gguf", drop_tensor="blk.3.attn_k.weight"),
                       r"missing tensor 'blk.3.attn_k.weight'"),
    "shape_mismatch": (lambda g, d: rewrite(g, d / "s.gguf", set_kv={"qwen35.feed_forward_length": 384}),
                       r"tensor 'blk.0.ffn_gate.weight' has shape \[256, 512\] but the metadata implies \[256, 384\]"),
    "wrong_arch": (lambda g, d: rewrite(g, d / "a.gguf", arch="llama"), r"unsupported architecture 'llama'"),
    "not_a_file": (lambda g, d: d / "nope.gguf", r"no such file"),
    # tensor data out of its place: another tensor's bytes read as weights (they had loaded, decoding garbage)
    "overlapping_data": (lambda g, d: patched(g, d, lambda b: b.__setitem__(
        slice(tensor_info_pos(g, "blk.1.ffn_up.weight")[1], tensor_info_pos(g, "blk.1.ffn_up.weight")[1] + 8),
        struct.pack("<Q", 0))), r"tensor 'blk.1.ffn_up.weight' data starts at offset 0 of the data section, but "
                                r"the tensors before it end at \d+ .* the file is damaged"),
    # a layer count the tensors cannot hold: refused before anything is allocated for it
    "huge_block_count": (lambda g, d: rewrite(g, d / "b.gguf", set_kv={"qwen35.block_count": 10**9}),
                         r"qwen35.block_count is 1000000000 but the file has only \d+ tensors"),
    # one layer short: the last layer's tensors left over (it had run a 7-layer model)
    "block_count_short": (lambda g, d: rewrite(g, d / "c.gguf", set_kv={"qwen35.block_count": 7}),
                          r"tensor 'blk.7.\w+.weight' is not part of the model its metadata describes"),
    "negative_rms_eps": (lambda g, d: rewrite(g, d / "e.gguf", set_kv={"qwen35.attention.layer_norm_rms_epsilon": -1.0}),
                         r"layer_norm_rms_epsilon must be a positive number"),
    "nan_rope_base": (lambda g, d: rewrite(g, d / "r.gguf", set_kv={"qwen35.rope.freq_base": float("nan")}),
                      r"rope.freq_base must be a positive number"),
    "eos_out_of_range": (lambda g, d: rewrite(g, d / "o.gguf", set_kv={"tokenizer.ggml.eos_token_id": 5000}),
                         r"tokenizer.ggml.eos_token_id must be a token id in 0..2047 \(got 5000\)"),
    "fifo": (lambda g, d: (__import__("os").mkfifo(d / "f.gguf"), d / "f.gguf")[1], r"not a regular file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_file_python(good, tmp_path, case):
    make, pattern = CASES[case]
    bad = make(good, tmp_path)
    with pytest.raises(DFlashError, match=pattern):
        Decoder(bad, threads=1)


@pytest.mark.parametrize("case", ["magic", "truncated_data", "unknown_type", "missing_tensor", "wrong_arch", "fifo",
                                  "overlapping_data"])
def test_bad_file_cli(good, tmp_path, case):
    make, pattern = CASES[case]
    bad = make(good, tmp_path)
    for args in (["generate", "-m", str(bad), "hi", "-n", "2"], ["info", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "dflash27b.cli", *args], capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        import re
        assert re.search(pattern, lines[0])


def test_prompt_longer_than_context(good):
    with Decoder(good, ctx=16, threads=1) as d:
        with pytest.raises(DFlashError, match="prompt of 20 tokens does not fit the context length 16"):
            d.generate(list(range(20)), 4)
        # the decoder still works afterwards
        assert len(d.generate(list(range(5)), 4, ignore_eos=True).tokens) == 4


def test_generation_stops_when_context_is_full(good):
    with Decoder(good, ctx=12, threads=1) as d:
        r = d.generate(list(range(8)), 50, ignore_eos=True)
        assert r.stats.stop_reason == "context_full" and len(r.tokens) == 5


def test_bad_arguments(good):
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        with Decoder(good, threads=1) as d:
            d.generate([1, 99999], 2)
    with pytest.raises(DFlashError, match="unknown kv_type"):
        Decoder(good, kv_type="q3")
    with pytest.raises(DFlashError, match="device .cuda. requested but"):
        Decoder(good, device="cuda")
    with pytest.raises(DFlashError, match="empty prompt"):
        with Decoder(good, threads=1) as d:
            d.generate([], 2)


def test_every_metadata_value_type_and_custom_alignment(good, tmp_path):
    """The reader walks keys of all 13 GGUF value types (arrays included) and honours
    general.alignment; the model computes exactly what the original file computes."""
    V = GGUFValueType
    extra = [("x.u8", 7, V.UINT8, None), ("x.i8", -7, V.INT8, None), ("x.u16", 700, V.UINT16, None),
             ("x.i16", -700, V.INT16, None), ("x.u32", 70000, V.UINT32, None), ("x.i32", -70000, V.INT32, None),
             ("x.f32", 1.5, V.FLOAT32, None), ("x.bool", True, V.BOOL, None), ("x.str", "héllo", V.STRING, None),
             ("x.u64", 2**40, V.UINT64, None), ("x.i64", -2**40, V.INT64, None), ("x.f64", 2.25, V.FLOAT64, None),
             ("x.arr_i16", [1, -2, 3], V.ARRAY, V.INT16), ("x.arr_str", ["a", "", "ccc"], V.ARRAY, V.STRING),
             ("x.arr_f64", [0.5, 1.5], V.ARRAY, V.FLOAT64), ("x.arr_bool", [True, False], V.ARRAY, V.BOOL)]
    other = rewrite(good, tmp_path / "extra.gguf", alignment=256, extra_kv=extra)
    assert GGUFReader(other).fields["general.alignment"].contents() == 256
    ids = [3, 14, 15, 92, 65]
    with Decoder(good, threads=1) as a, Decoder(other, threads=1) as b:
        assert np.array_equal(a.logits(ids), b.logits(ids))


def test_misaligned_tensor_offset(good, tmp_path):
    pos = tensor_info_pos(good, "blk.1.ffn_up.weight")[1]
    bad = patched(good, tmp_path, lambda b: b.__setitem__(
        slice(pos, pos + 8), struct.pack("<Q", struct.unpack("<Q", bytes(b[pos:pos + 8]))[0] + 4)))
    with pytest.raises(DFlashError, match=r"tensor 'blk.1.ffn_up.weight' data offset \d+ is not aligned to 32"):
        Decoder(bad, threads=1)


def test_a_chat_template_that_is_not_jinja_fails_chat_only(good, tmp_path):
    """A GGUF whose chat template does not parse still decodes raw prompts; a chat request gets one line
    naming the key (it was a jinja2 traceback)."""
    bad = rewrite(good, tmp_path / "t.gguf", set_kv={"tokenizer.chat_template": "{% for m in messages %}{{ m.content "})
    with Decoder(bad, threads=1) as d:
        assert len(d.generate("hi", 2, ignore_eos=True).tokens) == 2
        with pytest.raises(DFlashError, match=r"chat template \(tokenizer.chat_template\) is not valid Jinja"):
            d.generate([{"role": "user", "content": "hi"}], 2, chat=True)
