"""dflash27b.tools.synth and dflash27b.tools.kquant.

Synthetic files of every ftype must load with gguf's reader and carry the §6 type mix; the mix is also
checked on real shapes through `type_plan` (no data written); our K-quant encoders must decode (with gguf's
independent decoders) to within named error bounds; random blocks must have the requested statistics.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFReader
from gguf import quants as gq

from dflash27b.tokenizer import Tokenizer
from dflash27b.tools import kquant
from dflash27b.tools.layout import tensor_list
from dflash27b.tools.synth import (FTYPES, main, more_bits, resolve_shape, synth_tokenizer, type_plan,
                                   write_synthetic)

# relative RMS error (vs the data's std) of our straightforward-rounding encoders on Gaussian rows
MAX_REL_RMSE = {T.Q4_K: 0.10, T.Q5_K: 0.05, T.Q6_K: 0.025, T.Q8_0: 0.008, T.Q4_0: 0.12}
FILE_TYPE = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q8_0": 7, "q4_0": 2, "f16": 1, "bf16": 32, "f32": 0}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    return {ft: write_synthetic(d / f"tiny-{ft}.gguf", "tiny", ft, seed=0) for ft in FTYPES}


@pytest.mark.parametrize("ftype", FTYPES)
def test_tiny_file_loads_with_planned_types(tiny_files, ftype):
    r = GGUFReader(tiny_files[ftype])
    plan = type_plan(resolve_shape("tiny"), ftype)
    got = {t.name: t.tensor_type for t in r.tensors}
    assert got == plan
    assert len(got) == 109
    assert r.fields["general.file_type"].contents() == FILE_TYPE[ftype]
    assert r.fields["general.architecture"].contents() == "qwen35"
    shapes = {t.name: tuple(int(v) for v in reversed(t.shape)) for t in r.tensors}
    assert shapes == dict(tensor_list(resolve_shape("tiny")))
    for t in r.tensors:
        x = gq.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(x).all(), t.name


def test_tiny_q4_k_m_mix_matches_llama_quantize():
    plan = type_plan(resolve_shape("tiny"), "q4_k_m")
    q6 = {n for n, t in plan.items() if t == T.Q6_K}
    assert q6 == {"output.weight", "blk.0.attn_qkv.weight", "blk.6.attn_qkv.weight", "blk.3.attn_v.weight",
                  "blk.7.attn_v.weight", "blk.0.ffn_down.weight", "blk.3.ffn_down.weight",
                  "blk.6.ffn_down.weight", "blk.7.ffn_down.weight"}
    assert plan["token_embd.weight"] == T.Q4_K
    assert all(t == T.F32 for n, t in plan.items() if "norm" in n or n.endswith("ssm_a") or "ssm_dt" in n
               or "conv1d" in n)


def test_more_pattern_on_24_layers_tied():
    hp = resolve_shape("0.8b")
    plan = type_plan(hp, "q4_k_m")
    more = {i for i in range(24) if more_bits(i, 24)}
    assert more == {0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23}
    assert "output.weight" not in plan and plan["token_embd.weight"] == T.Q6_K   # tied: output rule
    for i in range(24):
        v = f"blk.{i}.attn_qkv.weight" if (i + 1) % 4 else f"blk.{i}.attn_v.weight"
        assert plan[v] == (T.Q6_K if i in more else T.Q4_K), v
        assert plan[f"blk.{i}.ffn_down.weight"] == (T.Q6_K if i in more else T.Q4_K)
    assert type_plan(hp, "q8_0")["token_embd.weight"] == T.Q8_0
    assert type_plan(hp, "q4_0")["token_embd.weight"] == T.Q6_K
    assert set(type_plan(hp, "q5_k_m").values()) == {T.F32, T.Q5_K, T.Q6_K}


def _size(hp, plan) -> int:
    total = 0
    for name, shape in tensor_list(hp):
        blk, sz = GGML_QUANT_SIZES[plan[name]]
        total += int(np.prod(shape)) // blk * sz
    return total


def test_27b_q4_k_m_plan_counts_and_size():
    hp = resolve_shape("27b")
    plan = type_plan(hp, "q4_k_m")
    c = Counter(plan.values())
    assert (len(plan), c[T.Q6_K], c[T.Q4_K], c[T.F32]) == (851, 65, 433, 353)
    assert _size(hp, plan) / 1e9 == pytest.approx(16.54, abs=0.01)
    q6_layers = sorted(int(n.split(".")[1]) for n, t in plan.items() if t == T.Q6_K and "ffn_down" in n)
    assert q6_layers == [i for i in range(64) if i < 8 or i >= 56 or (i - 8) % 3 == 2]


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0])
def test_quantize_round_trip(qtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((32, 1024)) * 0.03).astype(np.float32)
    x[1] += 0.02                                 # offset rows exercise the K-quant min
    x[2] = 0.0                                   # all-zero row
    x[3, :256] = 0.5                             # constant block
    q = kquant.quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (32, kquant.row_bytes(qtype, 1024))
    y = gq.dequantize(q, qtype).reshape(x.shape)  # gguf's reference decoder, not ours
    assert np.isfinite(y).all()
    rel = np.sqrt(np.mean((y - x) ** 2)) / x.std()
    assert rel < MAX_REL_RMSE[qtype], rel
    np.testing.assert_array_equal(y[2], 0)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0])
def test_random_blocks_statistics(qtype):
    rng = np.random.default_rng(2)
    b = kquant.random_blocks(qtype, 64, 2048, 0.05, rng)
    assert b.shape == (64, kquant.row_bytes(qtype, 2048))
    y = gq.dequantize(b, qtype)
    assert np.isfinite(y).all()
    assert y.std() == pytest.approx(0.05, rel=0.05)
    assert abs(y.mean()) < 0.02 * 0.05
    assert abs(y.reshape(64, -1).mean(1)).max() < 0.15 * 0.05   # no row is badly off-centre


def test_recipe_values(tiny_files):
    r = GGUFReader(tiny_files["f32"])
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    assert t["token_embd.weight"].std() == pytest.approx(0.5, rel=0.02)
    assert t["output.weight"].std() == pytest.approx(0.1, rel=0.02)
    assert t["blk.0.ffn_up.weight"].std() == pytest.approx(0.03, rel=0.03)
    assert t["blk.0.ssm_conv1d.weight"].std() == pytest.approx(0.25, rel=0.1)
    a = t["blk.0.ssm_a"]
    assert ((a <= -0.02) & (a >= -1.5)).all()
    for n in ("blk.0.attn_norm.weight", "blk.3.attn_q_norm.weight", "output_norm.weight", "blk.0.ssm_norm.weight"):
        k = (t[n] - 1) * 128
        assert np.array_equal(k, np.round(k)) and np.abs(k).max() <= 4, n
    low = t["blk.1.attn_qkv.weight"].view(np.uint32) & 0xFFFF
    assert not low.any()                                           # bf16-representable


def test_tokenizer_metadata(tiny_files):
    tok = Tokenizer.from_gguf(tiny_files["q4_k_m"])
    assert tok.vocab_size == 2048
    assert tok.tokens[2045:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_id == 2047 and tok.eos_ids == {2045, 2047}
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())             # merges learned
    assert synth_tokenizer(2048) is synth_tokenizer(2048)          # cached
    big = synth_tokenizer(248320)
    assert len(big["tokenizer.ggml.tokens"]) == 248320 and big["tokenizer.ggml.tokens"][-1] == "[PAD248319]"
    assert big["tokenizer.ggml.token_type"][-1] == 5


def test_random_quant_path_and_determinism(tmp_path):
    a = write_synthetic(tmp_path / "a.gguf", {"n_layer": 4}, "q4_k_m", seed=3, random_quant=True)
    b = write_synthetic(tmp_path / "b.gguf", {"n_layer": 4}, "q4_k_m", seed=3, random_quant=True)
    assert a.read_bytes() == b.read_bytes()
    r = GGUFReader(a)
    assert r.fields["qwen35.block_count"].contents() == 4 and len(r.tensors) == 3 + 3 * 14 + 11
    w = next(t for t in r.tensors if t.name == "blk.0.ffn_gate.weight")
    assert gq.dequantize(np.asarray(w.data), w.tensor_type).std() == pytest.approx(0.03, rel=0.05)


def test_cli(tmp_path, capsys):
    main([str(tmp_path / "c.gguf"), "--shape", '{"n_layer": 4, "vocab": 1024}', "--ftype", "q8_0"])
    assert "wrote" in capsys.readouterr().out
    r = GGUFReader(tmp_path / "c.gguf")
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 1024


def test_mtp_head_is_written_as_llama_cpp_writes_it(tmp_path):
    """`synth --mtp` (the GPU record's 27B for the drafters part): one more block, full attention, with the
    nextn tensors, nextn_predict_layers = 1; the trunk's recurrent pattern unchanged; -md mtp drafts with it."""
    from dflash27b import Decoder
    p = write_synthetic(tmp_path / "m.gguf", "tiny", "f32", seed=0, mtp=True)
    r = GGUFReader(str(p))
    kv = {f.name: f.parts[f.data[0]] for f in r.fields.values() if f.data}
    n = resolve_shape("tiny")["n_layer"]
    assert int(kv["qwen35.block_count"][0]) == n + 1 and int(kv["qwen35.nextn_predict_layers"][0]) == 1
    names = {t.name for t in r.tensors}
    assert {f"blk.{n}.nextn.{k}.weight" for k in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert f"blk.{n}.attn_q.weight" in names and f"blk.{n}.ssm_a" not in names
    with Decoder(str(p), "mtp", threads=2, ctx=256) as d:
        ar = d.generate("def f(x):", 12, mode="ar", ignore_eos=True).tokens
        assert d.generate("def f(x):", 12, mode="chain", ignore_eos=True).tokens == ar
