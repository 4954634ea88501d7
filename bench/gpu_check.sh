#!/usr/bin/env bash
# gpu_check.sh — the CUDA backend's check on a GPU machine, in one go:
#   1. installs the carried wheels (.whl/: cffi, pycparser, gguf) into /tmp/site
#   2. builds libdflash27b for sm_90 only (build/gpu), with the CUDA backend required,
#      and the backend op test (tests/cpp/backend_ops.cpp)
#   3. runs every backend op on the GPU against the CPU backend (build/gpu/dfl_backend_ops)
#   4. runs the CUDA tests: python3 -m pytest -q -m cuda tests/test_cuda_ops.py tests/test_cuda_forward.py
#   5. runs a few matmul tests and a tiny end-to-end DDTree decode under compute-sanitizer
#      memcheck and racecheck (GPU_CHECK_SANITIZE=0 skips)
#   6. prints tables: the bundled pair decoded on the GPU (AR, chain, DDTree: tok/s, accept,
#      speedup), then format, n, max rel err vs numpy, time and GB/s of weights read for the
#      17408x5120 (ffn up/gate) and 5120x17408 (ffn down) shapes
# Exit status: non-zero if the build, a test or the sanitizer failed.
#
# The machine needs python3 with numpy, pytest, cmake and nvcc; cffi, pycparser,
# gguf and rich (with markdown-it-py, mdurl, pygments) travel as wheels.  Prepare them where pip has network access:
#   mkdir -p .git/info; grep -q '^/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl cffi==2.0.0 pycparser==3.0 gguf==0.19.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
# (gguf also needs numpy, pyyaml, requests and tqdm, already on the GPU image.)
# Then, from the repository root on the GPU machine (carrying .whl):
#   bash bench/gpu_check.sh
# The log also goes to $OUT/gpu_check.log when OUT is set (else /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG=${OUT:-/tmp}/gpu_check.log
step() { echo; echo "==== $*"; }

main() {
status=0

step "machine"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH CUDACXX=/usr/local/cuda/bin/nvcc
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
command -v nvcc >/dev/null && nvcc --version | tail -2
python3 --version

step "wheels"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site
  ls .whl
else
  echo "no .whl/ carried: relying on installed cffi/pycparser/gguf"
fi
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}

step "build (sm_90)"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
t0=$(date +%s)
mkdir -p build
cmake -S . -B build/gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDFLASH27B_CUDA=ON -DDFLASH27B_BUILD_TESTS=ON \
  -DDFLASH27B_CUDA_ARCHITECTURES=90 >build/gpu.configure.log 2>&1 || { cat build/gpu.configure.log; return 1; }
cmake --build build/gpu -j "$(nproc)" 2>&1 | tail -20
[ -f build/gpu/libdflash27b.so ] || { echo "build failed"; return 1; }
echo "build: $(( $(date +%s) - t0 )) s"
export DFLASH27B_LIB=$ROOT/build/gpu/libdflash27b.so
python3 - <<'EOF'
from dflash27b._lib import load
ffi, lib = load()
info = ffi.string(lib.dfl_build_info()).decode()
n = lib.dfl_cuda_device_count()
print(f"build info: {info}; CUDA devices: {n}")
assert "sm_90" in info and n > 0, "CUDA backend not built or no device visible"
EOF
[ $? = 0 ] || return 1

step "backend ops on the GPU vs the CPU backend (batch 1..512, every format / KV type, chain + tree)"
build/gpu/dfl_backend_ops > build/backend_ops.log 2>&1; rc=$?
grep -v ": ok$" build/backend_ops.log | tail -30; echo "$(grep -c ': ok$' build/backend_ops.log) cases ok"
[ $rc = 0 ] || status=1

step "pytest -m cuda tests/test_cuda_ops.py tests/test_cuda_forward.py"
python3 -m pytest -q -p no:cacheprovider -m cuda -rxs tests/test_cuda_ops.py tests/test_cuda_forward.py || status=1

if [ "${GPU_CHECK_SANITIZE:-1}" != 0 ]; then
  step "compute-sanitizer memcheck (misaligned formats, both kernels, odd shapes)"
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$SAN" ]; then
    t=tests/test_cuda_ops.py
    "$SAN" --tool memcheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m cuda \
      "$t::test_cuda_matmul_shapes_and_misaligned_rows" \
      "$t::test_cuda_matmul_vs_numpy_and_cpu[Q4_0-1]" "$t::test_cuda_matmul_vs_numpy_and_cpu[Q8_0-7]" \
      "$t::test_cuda_matmul_vs_numpy_and_cpu[Q6_K-2]" "$t::test_cuda_matmul_vs_numpy_and_cpu[Q6_K-23]" \
      "$t::test_cuda_matmul_vs_numpy_and_cpu[Q5_K-7]" "$t::test_cuda_matmul_vs_numpy_and_cpu[F16-16]" \
      2>&1 | tail -15
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "memcheck: FAILED"; status=1; }
    for tool in memcheck racecheck; do
      step "compute-sanitizer $tool: tiny end-to-end DDTree decode on the GPU"
      "$SAN" --tool $tool --error-exitcode 99 python3 -c "
from dflash27b import Decoder
with Decoder(device='cuda', ctx=512, threads=4) as d:
    ar = d.generate('def fibonacci(n):', 24, ignore_eos=True, mode='ar').tokens
    dd = d.generate('def fibonacci(n):', 24, ignore_eos=True, mode='ddtree').tokens
    assert dd == ar, (dd, ar)
print('decode ok')" 2>&1 | tail -8
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "$tool: FAILED"; status=1; }
    done
  else
    echo "compute-sanitizer not found; skipped"
  fi
fi

step "bundled pair on the GPU (10 held-out prompts, 128 tokens)"
python3 -m dflash27b.cli bench --dataset models/heldout_prompts.jsonl --n-prompts 10 -n 128 \
  --device cuda --modes ar,chain,ddtree,auto --budgets 8,22 --no-peer --out build/gpu-bench 2>&1 | tail -12 || status=1

step "auto vs fixed budgets with the oracle drafter (synthetic 27B Q4_K_M; set SKIP_27B=1 to skip)"
if [ "${SKIP_27B:-0}" != 1 ]; then
  [ -f build/synth-27b.gguf ] || python3 -m dflash27b.cli synth build/synth-27b.gguf --shape 27b --ftype q4_k_m
  python3 bench/auto_cpu.py --device cuda --cases oracle --oracle-target build/synth-27b.gguf --budgets 8,16,22,32 \
    --repeats 3 --out build/gpu-auto.json 2>&1 | grep -v Loading | tail -8 || status=1
fi

step "table"
python3 - <<'EOF' || status=1
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_cuda_ops import FORMATS, ROWS, cuda_matmul, make_case
from dflash27b._lib import load, last_error

ffi, lib = load()
try:
    import torch
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    print(f"reference: device-to-device copy {2 * 10 * a.numel() / (e0.elapsed_time(e1) * 1e-3) / 1e9:.0f} GB/s "
          "(read + write)")
    del a, b
    torch.cuda.empty_cache()
except Exception as exc:  # torch is only for the reference line
    print(f"(no copy-bandwidth reference: {exc})")

def bench(tid, rows, cols, n, bpb, be):
    iters = 200 if n <= 8 else (50 if n <= 64 else 10)
    ms = lib.dfl_cuda_bench_matmul(tid, rows, cols, n, iters)
    if ms < 0:
        raise RuntimeError(last_error())
    gb = rows * (cols // be) * bpb / 1e9
    return ms, gb / (ms * 1e-3)

print(f"{'format':6} {'n':>4} {'rel err':>9} | {'up 17408x5120':>14} {'GB/s':>6} | {'down 5120x17408':>15} {'GB/s':>6}")
for name, (tid, be, bpb, _) in FORMATS.items():
    for n in (1, 2, 4, 8, 16, 64, 512):
        t, raw, wf, x = make_case(name, n)
        ref = x.astype(np.float64) @ wf.astype(np.float64).T
        y = cuda_matmul(t, raw, ROWS, wf.shape[1], x)
        rel = np.abs(y - ref).max() / np.abs(ref).max()
        ms_u, gbs_u = bench(int(tid), 17408, 5120, n, bpb, be)
        ms_d, gbs_d = bench(int(tid), 5120, 17408, n, bpb, be)
        print(f"{name:6} {n:4d} {rel:9.1e} | {ms_u:11.4f} ms {gbs_u:6.0f} | {ms_d:12.4f} ms {gbs_d:6.0f}", flush=True)
EOF

echo
[ $status = 0 ] && echo "gpu_check: OK" || echo "gpu_check: FAILED"
return $status
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
