"""DFlash drafter loading: config.json + model.safetensors validation, pair checks, fuzzing."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash27b._handles import Model
from dflash27b._lib import DFlashError, load
from tiny_draft import (DROP, build_target_layer_ids, make_tiny_draft, read_safetensors_raw, tensor_shapes,
                        write_safetensors_raw)


def draft_load(path, target=None):
    """Loads through the C ABI; returns the info dict or raises DFlashError with the core's message."""
    ffi, lib = load()
    h = lib.dfl_draft_load(str(path).encode(), target.handle if target is not None else ffi.NULL)
    if h == ffi.NULL:
        raise DFlashError(ffi.string(lib.dfl_last_error()).decode())
    try:
        info = ffi.new("dfl_draft_info*")
        assert lib.dfl_draft_get_info(h, info) == 0
        out = {k: getattr(info, k) for k in dir(info) if k != "target_layer_ids"}
        out["target_layer_ids"] = list(info.target_layer_ids)[:info.n_target_layers]
        return out
    finally:
        lib.dfl_draft_free(h)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dflash27b.tools.synth import write_synthetic
    p = write_synthetic(tmp_path_factory.mktemp("target") / "tiny-q4_k_m.gguf", "tiny", "q4_k_m")
    m = Model(p)
    yield m
    m.close()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), n_layers=2, block_size=8, mask_token_id=2000)


def expect_error(path, *fragments, target=None):
    with pytest.raises(DFlashError) as ei:
        draft_load(path, target)
    msg = str(ei.value)
    for f in fragments:
        assert f in msg, msg
    assert "\n" not in msg
    return msg


def copy_draft(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- good files

def test_build_target_layer_ids():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(8, 1) == [4]


def test_load_without_target(good):
    info = draft_load(good)
    assert (info["n_layer"], info["hidden"], info["n_head"], info["n_head_kv"], info["head_dim"], info["n_ff"]) == \
        (2, 256, 4, 2, 64, 512)
    assert (info["block_size"], info["mask_token_id"], info["n_vocab"]) == (8, 2000, 2048)
    assert info["target_layer_ids"] == [1, 5] and info["n_target_layers"] == 2
    assert info["n_sliding_layers"] == 0 and info["sliding_window"] == 0
    assert info["rope_theta"] == pytest.approx(1e7) and info["rms_eps"] == pytest.approx(1e-6)
    cfg = json.loads((good / "config.json").read_text())
    n_elems = sum(int(__import__("math").prod(s)) for _, s in tensor_shapes(cfg))
    assert info["weight_bytes"] == 2 * n_elems


def test_load_with_target(good, target):
    info = draft_load(good, target)
    assert info["hidden"] == target.info["n_embd"] and info["n_vocab"] == target.info["n_vocab"]


def test_load_by_safetensors_path(good, target):
    assert draft_load(good / "model.safetensors", target)["n_layer"] == 2


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_other_dtypes(tmp_path, target, dtype):
    d = make_tiny_draft(tmp_path / dtype, dtype=dtype)
    info = draft_load(d, target)
    assert info["weight_bytes"] % (4 if dtype == "f32" else 2) == 0 and info["target_layer_ids"] == [4]


def test_sliding_layers_and_derived_ids(tmp_path, target):
    d = make_tiny_draft(tmp_path / "swa", n_layers=3, target_layer_ids=DROP, sliding_window=32,
                        use_sliding_window=True,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    info = draft_load(d, target)
    assert info["target_layer_ids"] == build_target_layer_ids(8, 3) == [1, 3, 5]
    assert info["n_sliding_layers"] == 2 and info["sliding_window"] == 32


def test_top_level_dflash_keys(tmp_path, target):
    d = make_tiny_draft(tmp_path / "top")
    cfg = json.loads((d / "config.json").read_text())
    dc = cfg.pop("dflash_config")
    cfg.update(dc)
    (d / "config.json").write_text(json.dumps(cfg))
    assert draft_load(d, target)["mask_token_id"] == 2047


# ---------------------------------------------------------------- bad safetensors

def test_missing_files(tmp_path, good):
    expect_error(tmp_path / "nope", "no such file")
    d = copy_draft(good, tmp_path / "d")
    (d / "config.json").unlink()
    expect_error(d, "config.json not found")


def test_truncated_safetensors(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    st = d / "model.safetensors"
    raw = st.read_bytes()
    st.write_bytes(raw[:-100])
    expect_error(d, "model.safetensors", "truncated", "beyond the end of the data region")
    st.write_bytes(raw[:5])
    expect_error(d, "truncated safetensors file", "too short")


def test_header_length_past_eof(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    st = d / "model.safetensors"
    raw = st.read_bytes()
    st.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    expect_error(d, "header length", "runs past the end of the file")
    st.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    expect_error(d, "header length", "absurd")


def test_malformed_header_json(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    st = d / "model.safetensors"
    hdr, data = read_safetensors_raw(st)
    hb = json.dumps(hdr).encode()
    bad = hb.replace(b'"fc.weight": ', b'"fc.weight" ', 1)  # the ':' after a key is gone
    st.write_bytes(struct.pack("<Q", len(bad)) + bad + data)
    expect_error(d, "safetensors header: malformed JSON at byte", "expected ':'")
    bad = b'{"fc.weight": {"dtype": "BF16",}}'
    st.write_bytes(struct.pack("<Q", len(bad)) + bad + data)
    expect_error(d, "malformed JSON at byte 39", "expected a string key")  # 8 + offset of the '}' after the comma


def test_duplicate_tensor_name(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    st = d / "model.safetensors"
    hdr, data = read_safetensors_raw(st)
    hb = json.dumps(hdr).encode()
    entry = json.dumps({"norm.weight": hdr["norm.weight"]})[1:-1].encode()
    bad = hb[:-1] + b"," + entry + b"}"
    st.write_bytes(struct.pack("<Q", len(bad)) + bad + data)
    expect_error(d, "duplicate key 'norm.weight'")


def test_unknown_dtype(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    hdr["norm.weight"]["dtype"] = "F64"
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "tensor 'norm.weight'", "unsupported dtype 'F64'", "BF16, F16, F32")


def test_shape_offset_mismatch(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    hdr["norm.weight"]["shape"] = [255]
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "tensor 'norm.weight'", "shape [255] of BF16 needs 510 bytes", "span 512")


def test_reversed_offsets(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    b, e = hdr["norm.weight"]["data_offsets"]
    hdr["norm.weight"]["data_offsets"] = [e, b]
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "'norm.weight'", "reversed")


def test_overlapping_tensors(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    b, e = hdr["hidden_norm.weight"]["data_offsets"]
    hdr["norm.weight"]["data_offsets"] = [b + 2, e + 2]
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "'hidden_norm.weight'", "'norm.weight'", "overlap")


def test_missing_tensor(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    del hdr["layers.1.mlp.up_proj.weight"]
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "missing tensor 'layers.1.mlp.up_proj.weight'", "[512, 256]")


def test_unexpected_tensor(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    hdr["embed_tokens.weight"] = {"dtype": "BF16", "shape": [0], "data_offsets": [len(data), len(data)]}
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "unexpected tensor 'embed_tokens.weight'")


def test_wrong_tensor_shape(tmp_path, good):
    d = copy_draft(good, tmp_path / "d")
    hdr, data = read_safetensors_raw(d / "model.safetensors")
    hdr["layers.0.self_attn.k_proj.weight"]["shape"] = [256, 128]  # transposed: same byte count
    write_safetensors_raw(d / "model.safetensors", hdr, data)
    expect_error(d, "tensor 'layers.0.self_attn.k_proj.weight' has shape [256, 128], expected [128, 256]")


def test_fc_shape_follows_target_layer_ids(tmp_path):
    d = make_tiny_draft(tmp_path / "d", n_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 3, 5]
    (d / "config.json").write_text(json.dumps(cfg))
    expect_error(d, "tensor 'fc.weight' has shape [256, 512], expected [256, 768]")


# ---------------------------------------------------------------- bad config.json

@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "head_dim", "rms_norm_eps", "vocab_size",
                                 "mask_token_id"])
def test_missing_config_key(tmp_path, key):
    d = make_tiny_draft(tmp_path / "d", **{key: DROP})
    expect_error(d, "config.json", "missing config key", key)


def test_missing_target_layer_ids(tmp_path):
    d = make_tiny_draft(tmp_path / "d", target_layer_ids=DROP, num_target_layers=DROP)
    expect_error(d, "missing config key 'dflash_config.target_layer_ids'")


def test_bad_config_values(tmp_path):
    expect_error(make_tiny_draft(tmp_path / "a", hidden_size="256"), "'hidden_size' should be an integer")
    expect_error(make_tiny_draft(tmp_path / "b", layer_types=["full_attention"] * 3),
                 "'layer_types' has 3 entries but num_hidden_layers is 1")
    expect_error(make_tiny_draft(tmp_path / "c", layer_types=["sliding_attention"], use_sliding_window=True,
                                 sliding_window=0), "'sliding_window' = 0 is out of range")
    expect_error(make_tiny_draft(tmp_path / "e", layer_types=["linear_attention"]), "layer_types[0] is 'linear_attention'")
    expect_error(make_tiny_draft(tmp_path / "f", num_key_value_heads=3), "not a multiple of num_key_value_heads 3")
    expect_error(make_tiny_draft(tmp_path / "g", mask_token_id=2048), "mask_token_id 2048 is outside the drafter's vocab_size")
    d = make_tiny_draft(tmp_path / "h")
    (d / "config.json").write_text('{"hidden_size": 256,}')
    expect_error(d, "config.json: malformed JSON at byte 20")


# ---------------------------------------------------------------- pair validation

def test_target_layer_id_outside_target(tmp_path, target):
    d = make_tiny_draft(tmp_path / "d", n_layers=2, target_layer_ids=[1, 8])
    assert draft_load(d)["target_layer_ids"] == [1, 8]  # fine alone
    expect_error(d, "drafter/target mismatch", "target_layer_id 8 is outside the target's layers [0, 8)", target=target)


def test_hidden_size_mismatch(tmp_path, target):
    d = make_tiny_draft(tmp_path / "d", target_hidden=128)
    draft_load(d)
    expect_error(d, "drafter/target mismatch", "hidden_size 128 != target hidden size 256", target=target)


def test_vocab_mismatch(tmp_path, target):
    d = make_tiny_draft(tmp_path / "d", vocab=4096, mask_token_id=100)
    draft_load(d)
    expect_error(d, "drafter/target mismatch", "vocab_size 4096 != target vocab size 2048", target=target)


def test_mask_token_outside_target_vocab(tmp_path, target):
    d = make_tiny_draft(tmp_path / "d", vocab=4096, mask_token_id=3000)
    expect_error(d, "drafter/target mismatch", "mask_token_id 3000 is outside the target vocab [0, 2048)", target=target)


def test_derived_ids_need_matching_target(tmp_path, target):
    d = make_tiny_draft(tmp_path / "d", n_layers=1, target_layer_ids=DROP, num_target_layers=6)
    expect_error(d, "num_target_layers 6", "!= target layers 8", target=target)


# ---------------------------------------------------------------- fuzzing

_FUZZ = textwrap.dedent("""
    import random, shutil, sys
    from pathlib import Path
    from dflash27b._lib import load
    ffi, lib = load()
    src, work = Path(sys.argv[1]), Path(sys.argv[2])
    raw = (src / "model.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    rng = random.Random(1234)
    shutil.copy(src / "config.json", work / "config.json")
    n_ok = n_err = 0
    for it in range(200):
        b = bytearray(raw)
        kind = it % 5
        if kind == 0:
            b = b[:rng.randrange(len(b))]
        elif kind == 1:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(8 + hlen)] = rng.randrange(256)
        elif kind == 2:
            i = rng.randrange(8, 8 + hlen)
            b[i] = ord(rng.choice('{}[],:"0123456789-eE.\\\\u '))
        elif kind == 3:
            b[rng.randrange(8)] = rng.randrange(256)
        else:
            i = rng.randrange(8, 8 + hlen)
            b = b[:i] + b[i + rng.randint(1, 20):]
        (work / "model.safetensors").write_bytes(bytes(b))
        print(it, kind, flush=True)
        h = lib.dfl_draft_load(str(work).encode(), ffi.NULL)
        if h == ffi.NULL:
            msg = ffi.string(lib.dfl_last_error()).decode("utf-8", "replace")
            assert msg and "\\n" not in msg, repr(msg)
            n_err += 1
        else:
            info = ffi.new("dfl_draft_info*")
            assert lib.dfl_draft_get_info(h, info) == 0
            lib.dfl_draft_free(h)
            n_ok += 1
    print("done", n_ok, n_err)
""")


def test_fuzz_corruptions_never_crash(tmp_path, good):
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    import dflash27b  # the child imports the same package (and library) as this process
    env["PYTHONPATH"] = os.pathsep.join([str(Path(dflash27b.__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _FUZZ, str(good), str(work)], env=env, capture_output=True, text=True,
                       timeout=300)
    tail = (r.stdout[-2000:] + r.stderr[-2000:])
    assert r.returncode == 0, f"fuzz subprocess died (rc {r.returncode}); last output:\n{tail}"
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "done" and int(last[1]) + int(last[2]) == 200
    assert int(last[2]) > 100  # most corruptions must be refused


# ---------------------------------------------------------------- the JSON parser (through config.json)

def _cfg_text(d: Path) -> str:
    return (d / "config.json").read_text()


def test_json_escapes_and_unicode(tmp_path):
    d = make_tiny_draft(tmp_path / "d")
    t = _cfg_text(d)
    t = t.replace('"full_attention"', '"full\\u005fattention"')  # \\uXXXX decoded before comparing
    t = t.replace('"qwen3"', '"q\\ud83d\\ude00\\"\\\\\\/\\b\\f\\n\\r\\t \u00e9\u4e2d\U0001F600"')  # pair + raw UTF-8
    (d / "config.json").write_text(t, encoding="utf-8")
    assert draft_load(d)["n_layer"] == 1


@pytest.mark.parametrize("old,new,fragment", [
    ('"qwen3"', '"\\ud83d"', "high surrogate not followed by a low surrogate"),
    ('"qwen3"', '"\\ude00"', "unpaired low surrogate"),
    ('"qwen3"', '"\\u12G4"', "invalid hex digit"),
    ('"qwen3"', '"\\x"', "invalid escape character"),
    ('"qwen3"', '"a\tb"', "raw control character"),
    ('"hidden_size": 256', '"hidden_size": 0256', "leading zero"),
    ('"hidden_size": 256', '"hidden_size": NaN', "unexpected character"),
    ('"hidden_size": 256', '"hidden_size": -', "expected a digit"),
    ('"hidden_size": 256', '"hidden_size": 1e999', "number out of range"),
    ('"hidden_size": 256', '"hidden_size": 256, "hidden_size": 256', "duplicate key 'hidden_size'"),
    ('"use_cache": true', '"use_cache": tru', "invalid literal"),
    ('"use_cache": true', '"use_cache": [1, 2,]', "expected a value"),
])
def test_json_rejects(tmp_path, old, new, fragment):
    d = make_tiny_draft(tmp_path / "d")
    t = _cfg_text(d)
    assert old in t
    (d / "config.json").write_text(t.replace(old, new, 1))
    expect_error(d, "config.json: malformed JSON at byte", fragment)


def test_json_limits_and_bytes(tmp_path):
    d = make_tiny_draft(tmp_path / "d")
    t = _cfg_text(d)
    (d / "config.json").write_text(t.replace('"use_cache": true', '"use_cache": ' + "[" * 100 + "]" * 100))
    expect_error(d, "nesting deeper than the limit")
    (d / "config.json").write_bytes(t.replace('"qwen3"', '"q\xff"').encode("latin-1"))
    expect_error(d, "invalid UTF-8")
    (d / "config.json").write_bytes(t.replace('"qwen3"', '"q\xc0\xaf"').encode("latin-1"))  # overlong '/'
    expect_error(d, "invalid UTF-8")
    (d / "config.json").write_text(t + " x")
    expect_error(d, "unexpected data after the JSON value")
    (d / "config.json").write_text(t[: t.index('"vocab_size"') - 2])
    expect_error(d, "unexpected end of input inside an object")
    (d / "config.json").write_text("[]")
    expect_error(d, "config.json is a JSON array, expected an object")


# ---------------------------------------------------------------- interop with the reference safetensors package

def test_reference_package_interop(tmp_path, target):
    st_np = pytest.importorskip("safetensors.numpy")
    import numpy as np
    # our writer's F32 file reads back with the reference reader
    d = make_tiny_draft(tmp_path / "ours", dtype="f32")
    ref = st_np.load_file(str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    assert sorted(ref) == sorted(n for n, _ in tensor_shapes(cfg))
    assert all(ref[n].shape == s for n, s in tensor_shapes(cfg))
    # a file written by the reference writer loads in ours
    d2 = tmp_path / "theirs"
    d2.mkdir()
    shutil.copy(d / "config.json", d2 / "config.json")
    st_np.save_file({k: v.astype(np.float16) if v.ndim == 2 else v for k, v in ref.items()},
                    str(d2 / "model.safetensors"), metadata={"format": "pt"})
    info = draft_load(d2, target)
    assert info["weight_bytes"] == sum(v.size * (2 if v.ndim == 2 else 4) for v in ref.values())
