"""Block formats: dequantization bit-exact against gguf-py, quantised matmul
within a stated tolerance of the dequantised F32 matmul, KV writers sane."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from dflash27b._lib import check, load

# type -> (ggml id, block elems, block bytes, byte offsets of f16 scale fields)
FORMATS = {
    "F16": (T.F16, 1, 2, ()),
    "BF16": (T.BF16, 1, 2, ()),
    "Q8_0": (T.Q8_0, 32, 34, (0,)),
    "Q4_0": (T.Q4_0, 32, 18, (0,)),
    "Q4_K": (T.Q4_K, 256, 144, (0, 2)),
    "Q5_K": (T.Q5_K, 256, 176, (0, 2)),
    "Q6_K": (T.Q6_K, 256, 210, (208,)),
}
# Activations are quantised to int8: per 32 values for Q8_0/Q4_0 (about 2^-8
# relative noise per term, within 1% of the largest |y| over random rows), per
# 256 values for K-quants as llama.cpp's Q8_K (a coarser scale: within 2%).
MATMUL_REL_TOL = {"F32": 1e-6, "F16": 1e-6, "BF16": 1e-6, "Q8_0": 1e-2, "Q4_0": 1e-2, "Q4_K": 2e-2,
                  "Q5_K": 2e-2, "Q6_K": 2e-2}


def random_blocks(name, nb, rng):
    tid, be, bb, scale_offs = FORMATS[name]
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    if name in ("F16", "BF16"):
        vals = rng.standard_normal(nb).astype(np.float32) * 3
        if name == "F16":
            raw = vals.astype(np.float16).view(np.uint8).reshape(nb, 2)
            raw[::7] = np.frombuffer(np.float16(1e-6).tobytes(), np.uint8)  # subnormals too
        else:
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(nb, 2)
    for off in scale_offs:
        d = (rng.uniform(-1, 1, nb) * 0.05).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    return raw


def ours_dequant(tid, raw, n):
    ffi, lib = load()
    out = np.empty(n, np.float32)
    raw = np.ascontiguousarray(raw)
    check(lib.dfl_dequantize(int(tid), ffi.cast("void*", raw.ctypes.data), n, ffi.cast("float*", out.ctypes.data)))
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_bit_exact_vs_gguf_py(name):
    rng = np.random.default_rng(1)
    tid, be, bb, _ = FORMATS[name]
    nb = 64
    raw = random_blocks(name, nb, rng)
    ref = quants.dequantize(raw.reshape(-1), tid).astype(np.float32).reshape(-1)
    ours = ours_dequant(tid, raw, nb * be)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_f16_writer_matches_numpy_rounding():
    ffi, lib = load()
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(4096) * 10 ** rng.uniform(-8, 5, 4096),
                        [0.0, -0.0, 65504, 7e4, 1e-8, 6e-8, 3e-8]]).astype(np.float32)
    out = np.empty(len(x), np.uint16)
    check(lib.dfl_quantize(1, ffi.cast("float*", x.ctypes.data), len(x), ffi.cast("void*", out.ctypes.data)))
    with np.errstate(over="ignore"):  # overflow to inf is the behaviour under test
        ref = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("name,tid", [("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0)])
def test_kv_quantizers_roundtrip(name, tid):
    """The KV writers produce valid blocks (decoded by gguf-py) within their format's error."""
    ffi, lib = load()
    x = np.random.default_rng(3).standard_normal(32 * 64).astype(np.float32)
    bb = FORMATS[name][2]
    out = np.empty(64 * bb, np.uint8)
    check(lib.dfl_quantize(int(tid), ffi.cast("float*", x.ctypes.data), len(x), ffi.cast("void*", out.ctypes.data)))
    y = quants.dequantize(out, tid).reshape(-1)
    amax = np.abs(x.reshape(64, 32)).max(1, keepdims=True)
    step = amax / (127 if name == "Q8_0" else 8)
    # half a step of rounding plus the f16 rounding of the scale (x127 at most); Q4_0's range
    # [-8, 7] clips the extreme of the other sign by up to one step.
    bound = step * (0.5 + 127 * 2.0**-11) if name == "Q8_0" else step * 1.0
    assert (np.abs(y.reshape(64, 32) - x.reshape(64, 32)) <= bound + 1e-7).all()


@pytest.mark.parametrize("name", ["F32"] + list(FORMATS))
@pytest.mark.parametrize("ntok", [1, 3, 16])
def test_matmul_close_to_dequantized_f32(name, ntok):
    ffi, lib = load()
    rng = np.random.default_rng(4)
    rows, cols = 48, 512
    if name == "F32":
        tid, w = T.F32, rng.standard_normal((rows, cols)).astype(np.float32)
        wf = w
        raw = w.view(np.uint8)
    else:
        tid, be, bb, _ = FORMATS[name]
        raw = random_blocks(name, rows * cols // be, rng).reshape(rows, -1)
        wf = quants.dequantize(raw.reshape(-1), tid).astype(np.float32).reshape(rows, cols)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    y = np.empty((ntok, rows), np.float32)
    raw = np.ascontiguousarray(raw)
    check(lib.dfl_matmul(int(tid), ffi.cast("void*", raw.ctypes.data), rows, cols, ffi.cast("float*", x.ctypes.data),
                         ntok, ffi.cast("float*", y.ctypes.data), 2))
    ref = (x.astype(np.float64) @ wf.astype(np.float64).T)
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < MATMUL_REL_TOL[name], rel
    # each token's row is what it would be alone (batch invariance at the op level)
    y1 = np.empty((1, rows), np.float32)
    check(lib.dfl_matmul(int(tid), ffi.cast("void*", raw.ctypes.data), rows, cols,
                         ffi.cast("float*", x[-1:].ctypes.data), 1, ffi.cast("float*", y1.ctypes.data), 1))
    assert np.array_equal(y1[0], y[-1])


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"])
def test_quantised_matmul_is_the_reference_arithmetic_bit_for_bit(name):
    """The quantised kernels compute exactly `dfl_matmul_reference`'s arithmetic, one output at a
    time, on every build and kernel set (AVX2, AVX-512 where the CPU has it, scalar): K-quants (one
    super-block of registers for a few tokens, interleaved 4-row panels for 3+: 8-byte row pieces on
    AVX2, 16-byte pieces on AVX-512) and Q8_0 / Q4_0 (8 blocks' integer sums in one vector,
    8 float chains by block index; short last groups of 1..7 blocks), for every token count (tails
    of the 4-token quads and 2-token pairs, past the 64-token block), row counts that leave short
    panels, and 1 or 2 threads.  Q6_K with rows in fours reads its panels pre-transposed (made on the first
    matmul) unless DFLASH27B_CPU_Q6K_PANELS=0: the same bits both ways."""
    ffi, lib = load()
    rng = np.random.default_rng(11)
    tid, be, _, _ = FORMATS[name]
    tid = int(tid)
    # (rows in fours: Q6_K's pre-transposed panels, quant.h with_cpu_layout; other rows: the GGUF order)
    shapes = ((5, 256), (37, 1024), (64, 768), (36, 3584)) if be == 256 else \
        ((5, 32), (7, 96), (37, 288), (16, 1024), (9, 480))
    kernels = cpu_kernel_modes(lib)
    try:
        for rows, cols in shapes:
            raw = np.ascontiguousarray(random_blocks(name, rows * cols // be, rng).reshape(rows, -1))
            for n in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 70):
                x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 10)).astype(np.float32)
                ref = np.empty((n, rows), np.float32)
                check(lib.dfl_matmul_reference(tid, ffi.cast("void*", raw.ctypes.data), rows, cols,
                                               ffi.cast("float*", x.ctypes.data), n, ffi.cast("float*", ref.ctypes.data)))
                for avx512 in kernels:
                    check(lib.dfl_cpu_avx512(avx512))
                    for threads in (1, 2):
                        y = np.empty((n, rows), np.float32)
                        check(lib.dfl_matmul(tid, ffi.cast("void*", raw.ctypes.data), rows, cols,
                                             ffi.cast("float*", x.ctypes.data), n, ffi.cast("float*", y.ctypes.data), threads))
                        assert np.array_equal(y, ref), (rows, cols, n, threads, avx512)
    finally:
        check(lib.dfl_cpu_avx512(-1))


def test_q6k_weights_in_fours_are_read_from_their_panels():
    """A Q6_K weight whose rows come in fours is read from the panels pre-transposed on its first CPU matmul
    (quant.h with_cpu_layout) where the AVX2 kernels run, at every token count: the same bits as the
    reference (the test above), and the rows counted here show the panels were what was read.  Rows not in
    fours, and the AVX-512 kernels, read the GGUF order."""
    import os
    ffi, lib = load()
    if "avx2" not in ffi.string(lib.dfl_build_info()).decode() or os.environ.get("DFLASH27B_CPU_Q6K_PANELS") == "0":
        pytest.skip("no AVX2 kernels, or the panels turned off")
    rng = np.random.default_rng(5)
    tid = int(FORMATS["Q6_K"][0])

    def rows_read(rows, n, avx512=0):
        raw = np.ascontiguousarray(random_blocks("Q6_K", rows * 1024 // 256, rng).reshape(rows, -1))
        x = rng.standard_normal((n, 1024)).astype(np.float32)
        y = np.empty((n, rows), np.float32)
        check(lib.dfl_cpu_avx512(avx512))
        before = lib.dfl_cpu_q6k_panel_rows()
        check(lib.dfl_matmul(tid, ffi.cast("void*", raw.ctypes.data), rows, 1024, ffi.cast("float*", x.ctypes.data), n,
                             ffi.cast("float*", y.ctypes.data), 2))
        return lib.dfl_cpu_q6k_panel_rows() - before

    try:
        for n in (1, 2, 3, 4, 5, 9, 70):
            assert rows_read(64, n) == 64, n
        assert rows_read(37, 4) == 0
        if lib.dfl_cpu_avx512(1) == 0:
            assert rows_read(64, 4, avx512=1) == 0
    finally:
        check(lib.dfl_cpu_avx512(-1))


def cpu_kernel_modes(lib) -> list[int]:
    """The CPU kernel sets this machine can run: AVX2 / scalar (0), and AVX-512 (1) where the CPU has it."""
    return [0, 1] if lib.dfl_cpu_avx512(1) == 0 else [0]


def test_avx512_switch_reports_itself_and_refuses_bad_modes():
    """dfl_cpu_avx512 turns the AVX-512 batch kernels on or off for the process; the build string
    names the kernels in use; an unknown mode, or 'on' where the CPU or build lacks them, is an error
    that says so and changes nothing."""
    ffi, lib = load()
    try:
        info = lambda: ffi.string(lib.dfl_build_info()).decode()
        check(lib.dfl_cpu_avx512(0))
        assert "avx512" not in info()
        if lib.dfl_cpu_avx512(1) == 0:
            assert info().startswith("cpu: avx2+avx512;")
        else:
            msg = ffi.string(lib.dfl_last_error()).decode()
            assert "lacks AVX-512" in msg or "no AVX2 kernels" in msg, msg
            assert "avx512" not in info()
        before = info()
        assert lib.dfl_cpu_avx512(2) != 0
        assert "use 1 (on), 0 (off) or -1" in ffi.string(lib.dfl_last_error()).decode()
        assert info() == before
    finally:
        check(lib.dfl_cpu_avx512(-1))
