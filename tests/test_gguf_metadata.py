"""dfl_gguf_metadata_json (the core's GGUF reader, the one metadata parser) against gguf-py's GGUFReader on
every value type, and bad files refused with the reader's message."""
from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

from dflash27b._lib import DFlashError
from dflash27b.tokenizer import read_gguf_metadata


def _write(path):
    w = GGUFWriter(str(path), arch="qwen35")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 0.1)
    w.add_float32("t.f32nan", float("nan"))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", 'quote " backslash \\ newline \n tab \t bell \x07 é 漢 🙂')
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.25, 3.0e-8])
    w.add_array("t.arr_str", ["a", "Ġb", "<|im_end|>", ""])
    w.add_array("t.arr_bool", [True, False])
    w.add_tensor("x", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _oracle(path) -> dict:
    out = {}
    for name, f in GGUFReader(str(path)).fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        if t == VT.ARRAY:
            if f.types[-1] == VT.STRING:
                out[name] = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
            else:
                out[name] = [f.parts[i].tolist()[0] for i in f.data]
        elif t == VT.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
        else:
            out[name] = f.parts[f.data[0]].tolist()[0]
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or np.float32(a) == np.float32(b) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_value_type_equals_gguf_py(tmp_path):
    path = tmp_path / "meta.gguf"
    _write(path)
    ours, ref = read_gguf_metadata(path), _oracle(path)
    assert set(ours) == set(ref)
    for k in ref:
        assert _same(ours[k], ref[k]), (k, ours[k], ref[k])
    assert ours["t.f64"] == 1e-300 and ours["t.u64"] == 2**63 + 5 and ours["t.bool"] is True
    assert ours["t.str"].endswith("é 漢 🙂") and isinstance(ours["t.arr_bool"][0], bool)


def test_bad_files_are_refused_naming_the_problem(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(DFlashError, match="bad.gguf"):
        read_gguf_metadata(bad)
    with pytest.raises(DFlashError, match="nothere.gguf"):
        read_gguf_metadata(tmp_path / "nothere.gguf")
