"""CUDA matmul kernels (csrc/backend/cuda/matmul.cu) against numpy on gguf-dequantized
weights and against the CPU backend's dfl_matmul.

Tests marked `cuda` need a GPU (conftest skips them without one; on the lent
GPU machine bench/gpu_bench.sh runs them).  The others run everywhere: the
no-GPU behaviour of the entry points, and the kernels' source executed on the
CPU by the emulator in csrc/backend/cuda/emu (built with g++ when the build has CUDA).

dfl_cuda_matmul is the float kernels (activations kept in f32); dfl_cuda_matmul_exact
the batch-invariant kernels the forward uses (test_cuda_matmul_exact_equals_cpu).

Tolerances, as a fraction of max|y_ref| over the whole output (y_ref: f64
numpy product of the gguf-py-dequantized weights and the f32 activations):
  * CUDA vs y_ref: 1e-4 for every format.  The GPU keeps activations in f32
    and decodes weights exactly, so only f32 summation error remains
    (observed about 3e-7 for n <= 8, a few 1e-6 for the tiled n > 8 kernel).
  * CUDA vs CPU: the CPU's own stated tolerance (test_quant.MATMUL_REL_TOL:
    1e-6 for float weights, 1e-2 / 2e-2 for quantized ones, whose activations
    the CPU quantizes to int8) plus the CUDA tolerance.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash27b._lib import load, last_error

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# name -> (ggml type, block elems, block bytes, byte offsets of the f16 scale fields)
FORMATS = {
    "F32": (T.F32, 1, 4, ()),
    "F16": (T.F16, 1, 2, ()),
    "BF16": (T.BF16, 1, 2, ()),
    "Q4_0": (T.Q4_0, 32, 18, (0,)),
    "Q8_0": (T.Q8_0, 32, 34, (0,)),
    "Q4_K": (T.Q4_K, 256, 144, (0, 2)),
    "Q5_K": (T.Q5_K, 256, 176, (0, 2)),
    "Q6_K": (T.Q6_K, 256, 210, (208,)),
}
CUDA_REL_TOL = 1e-4
CPU_REL_TOL = {"F32": 1e-6, "F16": 1e-6, "BF16": 1e-6, "Q8_0": 1e-2, "Q4_0": 1e-2, "Q4_K": 2e-2,
               "Q5_K": 2e-2, "Q6_K": 2e-2}  # as tests/test_quant.py's MATMUL_REL_TOL
NS = [1, 2, 7, 16, 23, 64, 512]
ROWS = 37  # not a multiple of the 16 rows of a matvec CTA nor of the 64 of a tile


def cols_for(name: str) -> int:
    # Several 4096-column chunks at n = 1 with a partial last one; an odd block count.
    return 4352 if name.endswith("_K") else 4384


def random_blocks(name: str, nb: int, rng) -> np.ndarray:
    """nb random blocks (non-zero quants, finite f16 scales |d| <= 0.05) as uint8 [nb, block_bytes]."""
    tid, be, bb, scale_offs = FORMATS[name]
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)
    if name == "F32":
        raw = (rng.standard_normal(nb).astype(np.float32) * 3).view(np.uint8).reshape(nb, 4)
    elif name == "F16":
        vals = rng.standard_normal(nb).astype(np.float32) * 3
        raw = vals.astype(np.float16).view(np.uint8).reshape(nb, 2).copy()
        raw[::7] = np.frombuffer(np.float16(1e-6).tobytes(), np.uint8)  # subnormals too
    elif name == "BF16":
        vals = rng.standard_normal(nb).astype(np.float32) * 3
        raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(nb, 2)
    for off in scale_offs:
        d = (rng.uniform(-1, 1, nb) * 0.05).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    return np.ascontiguousarray(raw)


def make_case(name: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tid, be, bb, _ = FORMATS[name]
    cols = cols_for(name)
    raw = random_blocks(name, ROWS * cols // be, rng).reshape(ROWS, -1)
    wf = quants.dequantize(raw.reshape(-1), tid).astype(np.float32).reshape(ROWS, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    return int(tid), raw, wf, x


def cuda_matmul(tid: int, raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    ffi, lib = load()
    n = x.shape[0]
    y = np.full((n, rows), np.nan, np.float32)  # poisoned: every entry must be written
    x = np.ascontiguousarray(x, np.float32)
    rc = lib.dfl_cuda_matmul(tid, ffi.cast("void*", raw.ctypes.data), rows, cols,
                             ffi.cast("float*", x.ctypes.data), n, ffi.cast("float*", y.ctypes.data))
    assert rc == 0, last_error()
    return y


def cpu_matmul(tid: int, raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    ffi, lib = load()
    n = x.shape[0]
    y = np.full((n, rows), np.nan, np.float32)
    rc = lib.dfl_matmul(tid, ffi.cast("void*", raw.ctypes.data), rows, cols, ffi.cast("float*", x.ctypes.data), n,
                        ffi.cast("float*", y.ctypes.data), 4)
    assert rc == 0, last_error()
    return y


@pytest.mark.cuda
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_matmul_vs_numpy_and_cpu(name, n):
    tid, raw, wf, x = make_case(name, n)
    cols = wf.shape[1]
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    scale = np.abs(ref).max()
    y = cuda_matmul(tid, raw, ROWS, cols, x)
    assert np.isfinite(y).all(), "output left unwritten (NaN poison) or non-finite"
    rel = np.abs(y - ref).max() / scale
    assert rel < CUDA_REL_TOL, f"CUDA vs f64 reference: {rel:.2e}"
    y_cpu = cpu_matmul(tid, raw, ROWS, cols, x)
    rel_cpu = np.abs(y - y_cpu).max() / scale
    assert rel_cpu < CPU_REL_TOL[name] + CUDA_REL_TOL, f"CUDA vs CPU: {rel_cpu:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_matmul_batch_invariance(name):
    """A token's result does not depend on the rest of the batch: bit-exact for
    every n in 1..8 (matvec kernel) and for every n > 8 (tiled kernel)."""
    tid, raw, wf, x = make_case(name, 23, seed=5)
    cols = wf.shape[1]
    alone = cuda_matmul(tid, raw, ROWS, cols, x[-1:])
    for n in (2, 3, 5, 8):
        y = cuda_matmul(tid, raw, ROWS, cols, x[-n:])
        assert np.array_equal(y[-1], alone[0]), f"n={n}"
    y16 = cuda_matmul(tid, raw, ROWS, cols, x[:16])
    y23 = cuda_matmul(tid, raw, ROWS, cols, x)
    assert np.array_equal(y23[:16], y16)


def cuda_matmul_exact(tid: int, raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    ffi, lib = load()
    n = x.shape[0]
    y = np.full((n, rows), np.nan, np.float32)
    x = np.ascontiguousarray(x, np.float32)
    rc = lib.dfl_cuda_matmul_exact(tid, ffi.cast("void*", raw.ctypes.data), rows, cols,
                                   ffi.cast("float*", x.ctypes.data), n, ffi.cast("float*", y.ctypes.data))
    assert rc == 0, last_error()
    return y


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "F16", "BF16"])
def test_cuda_matmul_exact_equals_cpu(name):
    """The exact matmul (csrc/backend/cuda/matmul_exact.cuh) gives a token the same bits for every n (a decode, each
    kernel width, a verify of 9..64 tokens, more than one weight pass).  Quantised weights are the CPU's
    arithmetic: == dfl_matmul.  K-quants: the dp4a matvec for n <= 8, the tensor-core kernel above;
    Q8_0 / Q4_0: whole-block integer sums in 8 float chains by block index, the dp4a matvec for n <= 8,
    the tensor-core kernel above (the CPU's arithmetic on its AVX2 and scalar builds alike).  F16 /
    BF16: the tf32 tensor cores with x split into two tf32 parts (csrc/backend/cuda/matmul_half.cu), within f32
    rounding of the CPU's f32 dot products (about 3e-7 of the largest output on the emulator)."""
    tid, raw, wf, x = make_case(name, 70, seed=11)
    cols = wf.shape[1]
    x[3] *= 1e-3  # a small-scale token and an all-zero one (scale 0) as well
    x[4] = 0.0
    ffi, lib = load()
    quantised = name not in ("F16", "BF16")
    same = quantised
    full = cuda_matmul_exact(tid, raw, ROWS, cols, x)
    # K-quants: 37 rows are few, so verifies of up to 64 tokens take the matvec 8 tokens a pass; pin -1 sends
    # them to the tensor cores
    for pin in (0, -1) if name.endswith("_K") else (0,):
        assert lib.dfl_cuda_matvec_rows(pin) == 0, last_error()
        try:
            for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 23, 32, 33, 64, 70):
                y = cuda_matmul_exact(tid, raw, ROWS, cols, x[:n])
                assert np.array_equal(y, full[:n]), f"{name}: n={n} differs from the same tokens in a batch of 70"
                want = cpu_matmul(tid, raw, ROWS, cols, x[:n])
                if same:
                    assert np.array_equal(y, want), f"{name} n={n} pin {pin}"
                else:
                    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max(), f"{name} n={n}"
        finally:
            assert lib.dfl_cuda_matvec_rows(0) == 0
    alone = cuda_matmul_exact(tid, raw, ROWS, cols, x[-1:])
    assert np.array_equal(alone[0], full[-1])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_cuda_mma_split_gives_the_same_bits(name):
    """The K-quant tensor-core verify with every K split dfl_cuda_mma_split can pin: the streaming kernel with 1
    warp a row group (the lane takes its float steps itself, no barrier), 2 or 4 (the row's 17 super-blocks in
    rounds, the last one partly empty, sums met in shared memory), -1, the round-synchronous kernel, and -2, the
    tiled kernel (prefill chunks); 37 rows leave a row group half empty and a CTA's others empty.  Each == the
    CPU's dfl_matmul, token for token, for verifies of 9..64 tokens (two token CTAs above 32) and a 70-token
    prefill chunk (a pinned split takes it to the streaming kernel, 3 token CTAs).  A bad pin is refused."""
    tid, raw, wf, x = make_case(name, 70, seed=7)
    cols = wf.shape[1]
    ffi, lib = load()
    assert lib.dfl_cuda_matvec_rows(-1) == 0, last_error()  # 37 rows: else the matvec takes the verifies
    try:
        for split in (1, 2, 4, -1, -2, 0):
            assert lib.dfl_cuda_mma_split(split) == 0, last_error()
            for n in (9, 16, 17, 23, 32, 33, 64, 70):
                y = cuda_matmul_exact(tid, raw, ROWS, cols, x[:n])
                assert np.array_equal(y, cpu_matmul(tid, raw, ROWS, cols, x[:n])), f"{name} split {split} n={n}"
        for bad in (3, -3):
            assert lib.dfl_cuda_mma_split(bad) == -1
            assert "use 1, 2 or 4 warps" in last_error() and "-2 for the tiled" in last_error()
    finally:
        assert lib.dfl_cuda_mma_split(0) == 0
        assert lib.dfl_cuda_matvec_rows(0) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_cuda_tiled_kernel_gives_the_same_bits(name):
    """The tiled K-quant kernel of prefill chunks (128 rows x 64 tokens a CTA from shared-memory copies): 300 rows
    are two full row blocks and a partial one, 130 tokens two token blocks and a partial one, and 17 super-blocks
    a row make Q6_K's 210-byte blocks start at every even offset in their first 16-byte chunk (a row of 3,570
    bytes), the weight's last block reaching its end.  Every token == the CPU's dfl_matmul and == the token
    decoded alone; the automatic choice takes chunks of 65 and 130 tokens to it, and the pin (-2) takes
    verifies of 9 and 23 tokens there too."""
    rng = np.random.default_rng(13)
    tid, be, bb, _ = FORMATS[name]
    rows, cols = 300, cols_for(name)
    raw = random_blocks(name, rows * cols // be, rng).reshape(rows, -1)
    x = rng.standard_normal((130, cols)).astype(np.float32)
    x[7] = 0.0  # an all-zero token (activation scale 0)
    ffi, lib = load()
    want = cpu_matmul(int(tid), raw, rows, cols, x)
    alone = cuda_matmul_exact(int(tid), raw, rows, cols, x[-1:])
    assert np.array_equal(alone[0], want[-1])
    try:
        for pin, ns in ((0, (65, 130)), (-2, (9, 23))):
            assert lib.dfl_cuda_mma_split(pin) == 0, last_error()
            for n in ns:
                y = cuda_matmul_exact(int(tid), raw, rows, cols, x[-n:])
                assert np.array_equal(y, want[-n:]), f"{name} pin {pin} n={n}"
    finally:
        assert lib.dfl_cuda_mma_split(0) == 0


@pytest.mark.cuda
def test_cuda_mma_kernel_from_the_environment(tmp_path):
    """DFLASH27B_CUDA_MMA picks the tensor-core kernel of verifies and prefill chunks for a whole run (a GPU
    session can set aside a kernel without a rebuild): each choice gives a 70-token chunk the bits of
    dfl_matmul; an unknown value fails the matmul with the choices, and a pin set afterwards still applies."""
    import json
    import os
    import sys
    tid, raw, wf, x = make_case("Q6_K", 70, seed=3)
    np.save(tmp_path / "raw.npy", raw)
    np.save(tmp_path / "x.npy", x)
    code = f"""
import json, sys, numpy as np
sys.path.insert(0, {str(ROOT / "tests")!r})
from test_cuda_ops import cuda_matmul_exact, cpu_matmul, ROWS
from dflash27b._lib import load, last_error
raw, x = np.load({str(tmp_path / "raw.npy")!r}), np.load({str(tmp_path / "x.npy")!r})
ffi, lib = load()
out = {{}}
try:
    out["same"] = bool(np.array_equal(cuda_matmul_exact({tid}, raw, ROWS, x.shape[1], x),
                                      cpu_matmul({tid}, raw, ROWS, x.shape[1], x)))
except AssertionError as e:
    out["error"] = str(e)
    out["pin"] = lib.dfl_cuda_mma_split(-2)
    out["after_pin"] = bool(np.array_equal(cuda_matmul_exact({tid}, raw, ROWS, x.shape[1], x),
                                           cpu_matmul({tid}, raw, ROWS, x.shape[1], x)))
print(json.dumps(out))
"""
    for value in ("auto", "w1", "sync", "tiled", "fast"):
        env = {**os.environ, "DFLASH27B_CUDA_MMA": value}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        if value == "fast":
            assert "DFLASH27B_CUDA_MMA=fast: use auto, w1, w2, w4, sync or tiled" in got["error"]
            assert got["pin"] == 0 and got["after_pin"]
        else:
            assert got == {"same": True}, (value, got)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_cuda_matvec_rows_per_cta_give_the_same_bits(name):
    """The K-quant matvec with every CTA shape dfl_cuda_matvec_rows can pin: 16 rows (a lane group walks a whole
    row) and 8, 4, 2, 1 (the CTA's lane groups split a row's 17 super-blocks into rounds, the last one partly
    empty), for AR-sized batches and for verifies of few-row weights (8 tokens a pass): each == the CPU's
    dfl_matmul, token for token.  A bad pin is refused with the choices."""
    tid, raw, wf, x = make_case(name, 64, seed=5)
    cols = wf.shape[1]
    ffi, lib = load()
    try:
        for rows_per_cta in (16, 8, 4, 2, 1):
            assert lib.dfl_cuda_matvec_rows(rows_per_cta) == 0, last_error()
            for n in (1, 2, 3, 8, 9, 23, 64):
                y = cuda_matmul_exact(tid, raw, ROWS, cols, x[:n])
                assert np.array_equal(y, cpu_matmul(tid, raw, ROWS, cols, x[:n])), f"{name} R={rows_per_cta} n={n}"
        assert lib.dfl_cuda_matvec_rows(3) == -1
        assert "use 1, 2, 4, 8 or 16, or 0" in last_error()
    finally:
        assert lib.dfl_cuda_matvec_rows(0) == 0


@pytest.mark.cuda
def test_cuda_matmul_exact_refuses_other_formats():
    ffi, lib = load()
    w = np.zeros(2 * 128, np.uint8)
    x = np.zeros(32, np.float32)
    y = np.zeros(2, np.float32)
    rc = lib.dfl_cuda_matmul_exact(int(T.F32), ffi.cast("void*", w.ctypes.data), 2, 32,
                                   ffi.cast("float*", x.ctypes.data), 1, ffi.cast("float*", y.ctypes.data))
    assert rc == -1 and "Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, F16 or BF16, not F32" in last_error()


@pytest.mark.cuda
def test_cuda_matmul_shapes_and_misaligned_rows():
    """Odd row counts, block counts of 1..17 (chains with no block, short last groups) and rows that
    start at every 2-byte misalignment (Q8_0's 34-byte and Q4_0's 18-byte blocks): the float kernels
    within tolerance, the exact ones the CPU's bits."""
    rng = np.random.default_rng(9)
    for name in ("Q8_0", "Q4_0"):
        for rows, cols, n in [(1, 32, 1), (3, 32, 9), (16, 64, 4), (17, 96, 8), (65, 160, 70), (200, 544, 3),
                              (5, 288, 12)]:
            tid = int(getattr(T, name))
            raw = random_blocks(name, rows * cols // 32, rng).reshape(rows, -1)
            wf = quants.dequantize(raw.reshape(-1), tid).astype(np.float32).reshape(rows, cols)
            x = rng.standard_normal((n, cols)).astype(np.float32)
            ref = x.astype(np.float64) @ wf.astype(np.float64).T
            y = cuda_matmul(tid, raw, rows, cols, x)
            assert np.abs(y - ref).max() <= CUDA_REL_TOL * np.abs(ref).max(), (name, rows, cols, n)
            exact = cuda_matmul_exact(tid, raw, rows, cols, x)
            assert np.array_equal(exact, cpu_matmul(tid, raw, rows, cols, x)), (name, rows, cols, n)


@pytest.mark.cuda
def test_cuda_matmul_bad_arguments():
    ffi, lib = load()
    w = np.zeros(4096, np.uint8)
    x = np.zeros(512, np.float32)
    y = np.zeros(512, np.float32)
    wp, xp, yp = (ffi.cast("void*", w.ctypes.data), ffi.cast("float*", x.ctypes.data),
                  ffi.cast("float*", y.ctypes.data))
    assert lib.dfl_cuda_matmul(3, wp, 2, 32, xp, 1, yp) == -1
    assert "unsupported tensor type 3" in last_error()
    assert lib.dfl_cuda_matmul(int(T.Q4_K), wp, 2, 128, xp, 1, yp) == -1
    assert "multiple of 32 and of the Q4_K block size" in last_error()
    assert lib.dfl_cuda_matmul(0, wp, 2, 32, xp, 0, yp) == -1
    assert "n must be positive" in last_error()
    assert lib.dfl_cuda_matmul(0, ffi.NULL, 2, 32, xp, 1, yp) == -1
    assert "NULL" in last_error()
    assert lib.dfl_cuda_bench_matmul(int(T.Q4_K), 64, 256, 1, 3, 0) > 0, last_error()
    assert lib.dfl_cuda_bench_matmul(int(T.Q4_K), 64, 256, 9, 3, 1) > 0, last_error()
    assert lib.dfl_cuda_bench_matmul(int(T.Q8_0), 64, 256, 1, 3, 1) > 0, last_error()
    assert lib.dfl_cuda_bench_matmul(int(T.BF16), 64, 256, 9, 3, 1) > 0, last_error()
    assert lib.dfl_cuda_bench_matmul(int(T.F32), 64, 256, 1, 3, 1) == -1.0
    assert "exact matmul takes Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, F16 or BF16, not F32" in last_error()


@pytest.mark.cuda
def test_cuda_memory_counter_and_copy_bandwidth():
    """Every device allocation is counted (the GPU record's peak vs the plan): a context's bytes appear while
    it lives, within its plan, and leave with it; the copy benchmark returns a rate."""
    from dflash27b import Decoder

    ffi, lib = load()
    m = ffi.new("dfl_cuda_memory*")
    assert lib.dfl_cuda_memory_stats(m, 1) == 0, last_error()
    base = m.allocated
    with Decoder(device="cuda", ctx=256, threads=2) as d:
        assert lib.dfl_cuda_memory_stats(m, 0) == 0
        held = m.allocated - base
        assert 0 < held <= d.memory_plan["total"], (held, d.memory_plan)
        assert held >= d.memory_plan["weights"] + d.memory_plan["kv"]
        assert m.device_total > 0 and m.peak >= m.allocated
    assert lib.dfl_cuda_memory_stats(m, 0) == 0
    assert m.allocated == base and m.peak - base >= held
    assert lib.dfl_cuda_memory_stats(ffi.NULL, 0) == -1 and "NULL" in last_error()
    assert lib.dfl_cuda_bench_copy(1 << 20, 2) > 0, last_error()
    assert lib.dfl_cuda_bench_copy(10, 2) == -1.0 and "bench_copy needs" in last_error()


from conftest import _have_cuda_device  # noqa: E402  (the same rule that skips `cuda` tests)


def test_cuda_entry_points_without_gpu():
    """Without a GPU (or without the CUDA build) nothing crashes: 0 devices and a clear error."""
    if _have_cuda_device():
        pytest.skip("this machine has a CUDA device")
    ffi, lib = load()
    assert lib.dfl_cuda_device_count() == 0
    w = np.zeros(2 * 34, np.uint8)
    x = np.ones(32, np.float32)
    y = np.full(2, np.nan, np.float32)
    rc = lib.dfl_cuda_matmul(int(T.Q8_0), ffi.cast("void*", w.ctypes.data), 2, 32, ffi.cast("float*", x.ctypes.data),
                             1, ffi.cast("float*", y.ctypes.data))
    assert rc == -1
    msg = last_error()
    built = "not built" not in ffi.string(lib.dfl_build_info()).decode()
    if built:
        assert msg.startswith("no usable CUDA device"), msg
    else:
        assert msg == "CUDA backend not built", msg
    wk, xk = np.zeros(2 * 144, np.uint8), np.ones(256, np.float32)
    assert lib.dfl_cuda_matmul_exact(int(T.Q4_K), ffi.cast("void*", wk.ctypes.data), 2, 256,
                                     ffi.cast("float*", xk.ctypes.data), 1, ffi.cast("float*", y.ctypes.data)) == -1
    assert last_error() == msg
    assert lib.dfl_cuda_bench_matmul(int(T.Q8_0), 16, 32, 1, 1, 0) == -1.0
    assert lib.dfl_cuda_bench_copy(1 << 20, 1) == -1.0
    assert lib.dfl_cuda_memory_stats(ffi.new("dfl_cuda_memory*"), 0) == -1
    if not built:
        assert lib.dfl_cuda_attention_rows(1, 1) == -1 and last_error() == msg
    assert np.isnan(y).all()  # y untouched


def test_build_info_names_cuda_archs_when_built():
    ffi, lib = load()
    info = ffi.string(lib.dfl_build_info()).decode()
    m = re.search(r"cuda: (.*)$", info)
    assert m, info
    assert m.group(1) in ("not built", "emulator") or re.fullmatch(r"sm_\d+(,sm_\d+)*", m.group(1)), info


@pytest.mark.slow
def test_kernels_on_cpu_emulator(tmp_path):
    """The kernel source itself (csrc/backend/cuda/matmul_kernels.cuh, csrc/backend/cuda/formats.cuh) run on the CPU
    by csrc/backend/cuda/emu/emu_matmul.cpp: decoders bit-exact vs the reference dequantizers, matvec
    and tiled kernels within 1e-5 of an f64 reference, batch invariance for n <= 8."""
    cxx = shutil.which("g++")
    if not cxx:
        pytest.skip("no g++")
    exe = tmp_path / "emu_matmul"
    cmd = [cxx, "-std=c++20", "-O2", "-DDFL_EMU", "-Wno-unknown-pragmas", f"-I{ROOT / 'csrc/backend/cuda/emu/shim'}",
           f"-I{ROOT / 'csrc/backend/cuda'}", f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'include'}", str(ROOT / "csrc/backend/cuda/emu/emu_matmul.cpp"),
           str(ROOT / "csrc/quant/quant.cpp"), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ALL OK"), run.stdout[-4000:] + run.stderr[-2000:]
