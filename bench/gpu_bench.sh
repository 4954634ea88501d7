#!/usr/bin/env bash
# gpu_bench.sh — the GPU record on a bare, offline GPU machine, in three calls of under 10 minutes each.
#
# Before (here, with network):  bash bench/gpu_prepare.sh      -> .gpu/ (wheels, llama.cpp source, commit)
# On the GPU machine, carrying .gpu, three calls back to back (the build and the synthetic files stay on the machine
# while it is warm; a part that finds them gone redoes what it needs):
#   bash bench/gpu_bench.sh part1   machine; wheels; llama.cpp's llama-bench built with CUDA in the
#                                   background; the synthetic 27B Q4_K_M target + a drafter of z-lab's
#                                   published 27B drafter shapes written in the background; our library
#                                   built for sm_$ARCH; the backend op test (batches 1..512) and pytest -m cuda;
#                                   the four exactness checks
#   bash bench/gpu_bench.sh part2   llama-bench (tg128, pp512, pp8192, -fa on, -ngl 99) and ours on the same
#                                   file: AR decode / prefill, AR step, verify at 2..32 nodes (chain, tree),
#                                   drafter block, DDTree-22 step, commit, oracle drafter at accept length ~8,
#                                   memory peak vs plan, copy bandwidth; then the record
#   bash bench/gpu_bench.sh part3   compute-sanitizer memcheck + racecheck on a DDTree decode; 4 slots; the
#                                   MTP head, lookup and the portfolio on a 27B with an MTP head; the prefix
#                                   cache on an 8K-token conversation, the 24 GiB cap run (128K
#                                   context, Q4_0 KV, DDTree == AR), the matvec and matmul tables; the record again (all parts)
#   bash bench/gpu_bench.sh all     all three, one after the other
#   bash bench/gpu_bench.sh first   for a session with 15 minutes of device time, ONE call (timeout_s 600) with
#                                   --budget 540: part1, then a shortened part2 (ours first, then llama-bench
#                                   with what is left), then the record; each step's limit is cut to the time
#                                   left, steps that no longer fit are skipped (and named), and the record is
#                                   written with what ran
# Options: --arch N (default 90), --skip-llamacpp, --skip-sanitize, --dry-run (print the steps, run nothing),
#   --budget SECONDS (the whole call's time: every step ends in time for the record; default: no budget).
# Environment: COMMIT (the measured HEAD; default .gpu/commit, else git), OUT (the device tool's output
# folder). Under OUT, as the call goes (a call killed at its limit still explains itself): the console log
# gpu_bench-PART.log, written line by line, and gpu-logs.tar.gz (every build and step log, build/gpu-parts/*.json),
# refreshed every 20 s and after each step; at the end the record. A record cut short is assembled here
# from the tarball: tar -xzf gpu-logs.tar.gz && python3 bench/gpu_bench.py record --parts gpu-parts.
# Writes build/gpu-parts/*.json (one per part: bench/gpu_bench.py), bench/results/gpu-YYYYMMDD-HHMM.{json,md}.
# Exit status: 0 when every step of the part ran and passed; 1 otherwise (the record is still written).
# Sourced (as the tests do), it defines its functions and runs nothing.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# exported: a step runs in a child bash under `timeout` (run), where the step functions need them
export ROOT=$PWD
export GPU=$ROOT/.gpu
export PARTS=$ROOT/build/gpu-parts
export ARCH=90
SKIP_LLAMACPP=0
SKIP_SANITIZE=0
DRY=0
BUDGET=0
T0=$SECONDS
RESERVE=30  # seconds kept for the record at the end of a budgeted call

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

PART=

parse_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      part1|part2|part3|all|first) [ -z "$PART" ] || { echo "gpu_bench.sh: one part at a time (got $PART and $1)" >&2; exit 2; }
                       PART=$1 ;;
      --arch) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+a?$ ]] || { echo "gpu_bench.sh: --arch needs a number like 90" >&2; exit 2; }
              ARCH=$2; shift ;;
      --budget) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -gt "$RESERVE" ] ||
                  { echo "gpu_bench.sh: --budget needs a number of seconds above $RESERVE" >&2; exit 2; }
                BUDGET=$2; shift ;;
      --skip-llamacpp) SKIP_LLAMACPP=1 ;;
      --skip-sanitize) SKIP_SANITIZE=1 ;;
      --dry-run) DRY=1 ;;
      -h|--help) usage; exit 0 ;;
      *) echo "gpu_bench.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
  done
  [ -n "$PART" ] || { echo "gpu_bench.sh: name a part: part1, part2, part3, all or first" >&2; usage >&2; exit 2; }
  [ "$PART" != first ] || [ "$BUDGET" -gt 0 ] || BUDGET=540
}

status=0
SAVER=
step() { echo; echo "==== $(date -u +%H:%M:%S) $*"; }
# left: seconds of the budget still free for steps (the record's reserve kept back); a big number without one
left() {
  if [ "$BUDGET" -gt 0 ]; then echo $((BUDGET - RESERVE - (SECONDS - T0))); else echo 999999; fi
}
# run SECONDS NAME CMD...: one step under a time limit (cut to the budget left); a failure marks the part failed,
# the part goes on; a step the budget no longer fits is skipped, named, and marks the part failed
run() {
  local limit=$1 name=$2; shift 2
  local free; free=$(left)
  if [ "$free" -lt 15 ]; then
    step "$name"; echo "$name: SKIPPED (the time budget is spent)"; status=1; return 1
  fi
  [ "$free" -lt "$limit" ] && limit=$free
  step "$name"
  if [ $DRY = 1 ]; then echo "(dry run, limit ${limit}s) $*"; return 0; fi
  # `timeout` runs programs, not shell functions: a function step runs in a child bash that inherits it, and
  # the functions it calls
  declare -F "$1" > /dev/null && export -f $(declare -F | awk '{print $3}')
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@"
  local rc=$?
  save_logs
  [ $rc = 124 ] && echo "$name: timed out after ${limit}s"
  [ $rc = 0 ] || { echo "$name: FAILED (exit $rc)"; status=1; }
  return $rc
}
# background JOB CMD...: a job that outlives this call (setsid) while the machine stays warm;
# build/JOB.done holds its exit status when it ends
background() {
  local job=$1; shift
  step "background: $job"
  if [ $DRY = 1 ]; then echo "(dry run) $*"; return 0; fi
  rm -f "build/$job.done"
  : > "build/$job.log"  # now, not when the job's shell gets to it: a wait_for right after must find it started
  setsid bash -c '"$@" > "build/'"$job"'.log" 2>&1; echo $? > "build/'"$job"'.done"' _ "$@" < /dev/null &
  echo "started $job (log build/$job.log)"
}
# wait_for JOB SECONDS: waits for a background job; 0 when it ended well
wait_for() {
  local job=$1 limit=$2 t=0
  [ $DRY = 1 ] && return 0
  [ -f "build/$job.log" ] || { echo "$job: was not started"; return 1; }
  local free; free=$(left)
  [ "$free" -lt "$limit" ] && limit=$free
  while [ ! -f "build/$job.done" ] && [ $t -lt "$limit" ]; do sleep 5; t=$((t + 5)); done
  [ -f "build/$job.done" ] || { echo "$job: not done after ${limit}s more (log: build/$job.log)"; tail -5 "build/$job.log"; return 1; }
  [ "$(cat "build/$job.done")" = 0 ] || { echo "$job: failed"; tail -20 "build/$job.log"; return 1; }
}
running() { [ -f "build/$1.log" ] && [ ! -f "build/$1.done" ]; }
# save_logs: every log and part JSON so far -> $OUT/gpu-logs.tar.gz (replaced whole, never half-written)
save_logs() {
  [ -n "${OUT:-}" ] && [ $DRY = 0 ] || return 0
  local tmp="$OUT/.gpu-logs.tar.gz.tmp"
  (cd build && tar -czf "$tmp" --ignore-failed-read $(ls -d *.log gpu-parts llamacpp/toolkit.json \
     llamacpp/configure.log llamacpp/build.log 2>/dev/null)) 2>/dev/null && mv -f "$tmp" "$OUT/gpu-logs.tar.gz"
}
# saving_logs_every N: save_logs every N seconds in the background until the call ends
saving_logs_every() {
  [ -n "${OUT:-}" ] && [ $DRY = 0 ] || return 0
  (while sleep "$1"; do save_logs; done) &
  SAVER=$!
}

setup_env() {
  mkdir -p build "$PARTS"
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  local whl=$GPU/whl
  [ -d "$whl" ] || whl=$ROOT/.whl
  if [ $DRY = 0 ] && ls "$whl"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$whl"/*.whl || { echo "wheel install failed"; return 1; }
    export PYTHONPATH=/tmp/site
  else
    echo "no wheels carried (.gpu/whl): relying on installed cffi / pycparser / gguf"
  fi
  export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export DFLASH27B_LIB=$ROOT/build/gpu/libdflash27b.so
  if [ -z "${COMMIT:-}" ]; then
    COMMIT=$(cat "$GPU/commit" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
  fi
  export COMMIT
}

# source_hash: a digest of what the library is built from (sources, headers, build files).  The library carried
# in .gpu/prebuilt-smN (bench/gpu_prepare.sh builds it there) is used only when it was built from exactly these:
# on the device, nvcc spends minutes of the call's 10 (backend.cu alone was past 300 s on an H200 host)
source_hash() {
  # (what .gitignore keeps out of a device call is left out here too: it would not be there to digest; and what
  # only the CPU emulator's build reads, its shim, its memory trace and their check programs, which no nvcc build
  # compiles)
  (cd "$ROOT" && find CMakeLists.txt csrc include tests/cpp -type f -not -path '*/__pycache__/*' -not -name '*.so' \
     -not -name '*.o' -not -name '*.pyc' -not -path 'csrc/backend/cuda/emu/shim/*' \
     -not -path 'csrc/backend/cuda/emu/memtrace.cpp' -not -path 'tests/cpp/emu_launch_checks.cpp' \
     -not -path 'tests/cpp/emu_memtrace_checks.cpp' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum |
     cut -c1-16)
}
# device_check: exit 0 when the library loads, was built for sm_$ARCH and sees a GPU; 2 when it is right but no
# GPU is visible (a rebuild would not help); 1 otherwise
device_check() {
  python3 -c "
import sys
from dflash27b._lib import load
ffi, lib = load()
info = ffi.string(lib.dfl_build_info()).decode()
n = lib.dfl_cuda_device_count()
print('build info:', info, '| CUDA devices:', n)
sys.exit(1 if 'sm_$ARCH' not in info else 0 if n > 0 else 2)"
}
# use_prebuilt: the carried library and op test in build/gpu, if they were built here from these sources
use_prebuilt() {
  local dir=$GPU/prebuilt-sm$ARCH want
  [ -f "$dir/source.sha256" ] || { echo "no prebuilt library for sm_$ARCH carried ($dir)"; return 1; }
  want=$(source_hash)
  if [ "$(cat "$dir/source.sha256")" != "$want" ]; then
    echo "the carried library was built from other sources ($(cat "$dir/source.sha256"), these are $want): building"
    return 1
  fi
  mkdir -p build/gpu || return 1
  local f
  for f in libdflash27b.so dfl_backend_ops; do  # xz-compressed: the call's whole tree travels in 64 MiB
    if command -v xz > /dev/null; then xz -dc "$dir/$f.xz" > "build/gpu/$f"
    else python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
           "$dir/$f.xz" "build/gpu/$f"; fi || { echo "could not unpack $dir/$f.xz"; return 1; }
  done
  chmod +x build/gpu/libdflash27b.so build/gpu/dfl_backend_ops &&
    echo "prebuilt library for sm_$ARCH (sources $want, built by bench/gpu_prepare.sh): no build here"
}

build_ours() {
  if use_prebuilt; then
    device_check; local rc=$?
    [ $rc = 1 ] || return $rc
    echo "the prebuilt library failed its check: building"; rm -f build/gpu/libdflash27b.so build/gpu/dfl_backend_ops
  fi
  compile_ours || return 1
  device_check
}
# compile_ours: configure and build build/gpu for sm_$ARCH with every core (also what gpu_prepare.sh runs here)
compile_ours() {
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S . -B build/gpu "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DDFLASH27B_CUDA=ON -DDFLASH27B_BUILD_TESTS=ON \
    -DDFLASH27B_CUDA_ARCHITECTURES="$ARCH" > build/gpu.configure.log 2>&1 || { tail -30 build/gpu.configure.log; return 1; }
  # the whole log stays in build/gpu.build.log (and the logs tarball); the console gets its errors
  if ! cmake --build build/gpu -j "$(nproc)" > build/gpu.build.log 2>&1; then
    grep -m 30 -E "error|Error" build/gpu.build.log; tail -10 build/gpu.build.log; return 1
  fi
  tail -2 build/gpu.build.log
}

# start_background_jobs [small]: llama.cpp's build and the synthetic files, each its own job, side by side
# (each writer is single-threaded); `small` also writes the 0.8B file only part3 reads
start_background_jobs() {
  if [ $SKIP_LLAMACPP = 0 ] && [ ! -x build/llamacpp/bin/llama-bench ] && ! running llamacpp; then
    if [ -s "$GPU/llamacpp-src.tar.gz" ]; then
      background llamacpp nice -n 10 bash bench/gpu_llamacpp.sh "$GPU/llamacpp-src.tar.gz" build/llamacpp "$ARCH"
    else
      echo "no $GPU/llamacpp-src.tar.gz carried: llama.cpp is not measured (bench/gpu_prepare.sh makes it)"
    fi
  fi
  [ -s build/synth-27b.gguf ] || running synth27 ||
    background synth27 nice -n 5 python3 -m dflash27b.cli synth build/synth-27b.gguf --shape 27b --ftype q4_k_m
  [ -s build/synth-27b-draft/model.safetensors ] || running synthdraft ||
    background synthdraft nice -n 5 python3 -m dflash27b.cli synth build/synth-27b-draft --shape 27b --drafter
  if [ "${1:-}" = small ]; then
    [ -s build/synth-0.8b.gguf ] || running synth08 ||
      background synth08 nice -n 5 python3 -m dflash27b.cli synth build/synth-0.8b.gguf --shape 0.8b --ftype q4_k_m
    # the 27B with an MTP head (one more block): the drafters part's; written while the parts before it run
    [ -s build/synth-27b-mtp.gguf ] || running synth27mtp ||
      background synth27mtp nice -n 5 python3 -m dflash27b.cli synth build/synth-27b-mtp.gguf --shape 27b \
        --ftype q4_k_m --mtp
  fi
}
# wait_for_synth SECONDS [small]: the synthetic files part2 (and with small, part3) reads
wait_for_synth() {
  local j ok=0
  for j in synth27 synthdraft ${2:+synth08}; do
    if running $j || [ -f build/$j.done ]; then wait_for $j "$1" || ok=1; fi
  done
  [ $DRY = 1 ] || { [ -s build/synth-27b.gguf ] && [ -s build/synth-27b-draft/model.safetensors ]; } || ok=1
  [ -z "${2:-}" ] || [ $DRY = 1 ] || [ -s build/synth-0.8b.gguf ] || ok=1
  return $ok
}

sanitize() {
  if [ $SKIP_SANITIZE = 0 ]; then
    local SAN
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
    if [ -n "$SAN" ] || [ $DRY = 1 ]; then
      local decode="from dflash27b import Decoder
with Decoder(device='cuda', ctx=512, threads=4) as d:
    ar = d.generate('def fibonacci(n):', 24, ignore_eos=True, mode='ar').tokens
    dd = d.generate('def fibonacci(n):', 24, ignore_eos=True, mode='ddtree').tokens
    assert dd == ar, (dd, ar)
print('decode ok')"
      local t=tests/test_cuda_ops.py
      run 150 "compute-sanitizer memcheck: matmul shapes, the exact matmul, DDTree on Q4_K_M and Q8_0 targets + a DDTree decode" bash -c "
        '$SAN' --tool memcheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m cuda \
          '$t::test_cuda_matmul_shapes_and_misaligned_rows' '$t::test_cuda_matmul_vs_numpy_and_cpu[Q6_K-23]' \
          '$t::test_cuda_matmul_exact_equals_cpu' 'tests/test_cuda_forward.py::test_cuda_target_spec_equals_ar[q4_k_m]' 'tests/test_cuda_forward.py::test_cuda_target_spec_equals_ar[q8_0]' \
          > build/memcheck-matmul.log 2>&1; a=\$?
        '$SAN' --tool memcheck --error-exitcode 99 python3 -c \"$decode\" > build/memcheck-decode.log 2>&1; b=\$?
        tail -3 build/memcheck-matmul.log build/memcheck-decode.log; [ \$a = 0 ] && [ \$b = 0 ]"
      run 150 "compute-sanitizer racecheck: the exact matmul's shared-memory rounds + a DDTree decode" bash -c "
        '$SAN' --tool racecheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m cuda \
          '$t::test_cuda_matmul_exact_equals_cpu' > build/racecheck-matmul.log 2>&1; a=\$?
        '$SAN' --tool racecheck --error-exitcode 99 python3 -c \"$decode\" > build/racecheck-decode.log 2>&1; b=\$?
        tail -3 build/racecheck-matmul.log build/racecheck-decode.log; [ \$a = 0 ] && [ \$b = 0 ]"
    else
      echo "compute-sanitizer not found: sanitizer not run"
    fi
  fi
}

# the tests' and (when they ran) the sanitizers' summary -> build/gpu-parts/checks.json
checks_summary() {
  local san=()
  [ -f build/memcheck-decode.log ] && san+=(--memcheck build/memcheck-matmul.log --memcheck build/memcheck-decode.log)
  [ -f build/racecheck-decode.log ] && san+=(--racecheck build/racecheck-matmul.log --racecheck build/racecheck-decode.log)
  run 30 "test and sanitizer summary" python3 bench/gpu_bench.py checks --junit build/gpu-pytest.xml \
    --backend-ops build/backend_ops.log "${san[@]}" --out "$PARTS/checks.json"
}

part1() {
  step "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  python3 --version; nproc; df -h "$ROOT" | tail -1
  start_background_jobs
  run 300 "build (sm_$ARCH)" build_ours || return 1
  run 120 "backend ops on the GPU vs the CPU backend (batches 1..512)" \
    bash -c "build/gpu/dfl_backend_ops > build/backend_ops.log 2>&1; rc=\$?; grep -v ': ok$' build/backend_ops.log | tail -20; exit \$rc"
  # in `first` the rerun is capped (and stops at its first failure): it only says whether graphs are to blame
  local rerun=240 maxfail=()
  [ "$PART" = first ] && { rerun=60; maxfail=(--maxfail=1); }
  run 240 "pytest -m cuda" python3 -m pytest -q -p no:cacheprovider -m cuda -rxs --junitxml=build/gpu-pytest.xml \
    tests/test_cuda_ops.py tests/test_cuda_forward.py ||
    run $rerun "pytest -m cuda again with graph mode off (DFLASH27B_CUDA_GRAPHS=0): do the failures follow it?" \
      env DFLASH27B_CUDA_GRAPHS=0 python3 -m pytest -q -p no:cacheprovider -m cuda -rxs "${maxfail[@]}" \
      tests/test_cuda_forward.py
  run 120 "exactness on the bundled pair (CUDA AR vs CPU AR, chain / DDTree / sampled DDTree vs CUDA AR)" \
    python3 bench/gpu_bench.py exact --device cuda --out "$PARTS/exact.json"
  checks_summary
  step "background jobs"
  for j in llamacpp synth27 synthdraft synth08; do
    if running $j; then echo "$j: still running ($(tail -c 200 build/$j.log | tr '\n' ' '))"
    elif [ -f build/$j.done ]; then echo "$j: done, exit $(cat build/$j.done)"; fi
  done
}

part2() {
  [ -f build/gpu/libdflash27b.so ] || [ $DRY = 1 ] || run 300 "build (sm_$ARCH)" build_ours || return 1
  start_background_jobs
  step "synthetic 27B Q4_K_M target + 27B-shaped drafter"
  wait_for_synth 300 || { status=1; return 1; }
  ls -la build/synth-27b.gguf build/synth-27b-draft 2>/dev/null
  if [ $SKIP_LLAMACPP = 0 ]; then
    step "llama.cpp build"
    if [ -x build/llamacpp/bin/llama-bench ] || wait_for llamacpp 240; then
      run 240 "llama-bench on the same file (tg128, pp512, pp8192; -fa 1 -ngl 99)" \
        python3 bench/gpu_bench.py llamacpp --bench build/llamacpp/bin/llama-bench --model build/synth-27b.gguf \
        --out "$PARTS/llamacpp.json"
    else
      status=1
    fi
  fi
  run 420 "ours on the same file: decode, prefill, steps, oracle, memory" \
    python3 bench/gpu_bench.py ours --device cuda --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --out "$PARTS/ours.json"
}

# part2 shortened for one budgeted call: ours first (one repeat, verify at 2 / 8 / 23 nodes, shorter runs), then
# llama-bench with what is left: its CUDA build (~5-6 min on 16 cores) runs in the background meanwhile
part2_short() {
  start_background_jobs
  step "synthetic 27B Q4_K_M target + 27B-shaped drafter"
  wait_for_synth 240 || { status=1; return 1; }
  run 300 "ours on the same file, short: decode, prefill, verify 2/8/23, DDTree-22, oracle, memory" \
    python3 bench/gpu_bench.py ours --device cuda --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --repeats 1 --n-decode 64 --nodes 2,8,23 --steps-tokens 16 --out "$PARTS/ours.json"
  # ~40 s while llama.cpp builds: which matvec CTA shape and which verify K split stream each weight fastest
  run 120 "K-quant matvec by rows per CTA (the AR step's shapes, n 1 and 8), the verify by K split (n 16, 23, 64, 512)" \
    python3 bench/gpu_bench.py matvec --out "$PARTS/matvec.json"
  if [ $SKIP_LLAMACPP = 0 ]; then
    step "llama.cpp build"
    # llama-bench itself needs ~60 s of what is left (load 16 GB, pp8192, tg128)
    local wait_s=$(( $(left) - 60 ))
    [ $wait_s -gt 0 ] || wait_s=0
    if [ -x build/llamacpp/bin/llama-bench ] || wait_for llamacpp $wait_s; then
      run 120 "llama-bench on the same file (tg128, pp512, pp8192; -fa 1 -ngl 99; 1 repeat)" \
        python3 bench/gpu_bench.py llamacpp --bench build/llamacpp/bin/llama-bench --model build/synth-27b.gguf \
        --reps 1 --out "$PARTS/llamacpp.json"
    else
      status=1
    fi
  fi
}

part3() {
  [ -f build/gpu/libdflash27b.so ] || [ $DRY = 1 ] || run 300 "build (sm_$ARCH)" build_ours || return 1
  if [ $DRY = 0 ]; then
    start_background_jobs small
    wait_for_synth 300 small || { status=1; return 1; }
  fi
  sanitize
  checks_summary
  run 120 "4 requests at once (slots, one batched forward a step) vs one stream (27B + drafter)" \
    python3 bench/gpu_bench.py slots --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --out "$PARTS/slots.json"
  if wait_for synth27mtp 180; then
    run 150 "the MTP head, lookup and the portfolio on the 27B with an MTP head (costs in AR steps)" \
      python3 bench/gpu_bench.py drafters --target build/synth-27b-mtp.gguf --draft build/synth-27b-draft \
      --out "$PARTS/drafters.json"
  else
    status=1
  fi
  run 120 "prefix cache: turn 2 of an 8K-token conversation vs turn 1 (27B)" \
    python3 bench/gpu_bench.py prefix --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --out "$PARTS/prefix.json"
  run 150 "27B + drafter under a 24 GiB cap: 128K context, Q4_0 KV, DDTree-22 after a 4K prompt" \
    python3 bench/gpu_bench.py vram24 --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --out "$PARTS/vram24.json"
  run 180 "the same at 262K context with the drafter in Q8_0 (--draft-type q8_0)" \
    python3 bench/gpu_bench.py vram24 --target build/synth-27b.gguf --draft build/synth-27b-draft \
    --ctx 262144 --draft-type q8_0 --out "$PARTS/vram24_262k.json"
  run 90 "draft model: a 0.8B-shaped qwen35 drafting for the 27B (chain / DDTree, block 5 and 9)" \
    python3 bench/gpu_bench.py draftmodel --target build/synth-27b.gguf --draft build/synth-0.8b.gguf \
    --out "$PARTS/draftmodel.json"
  run 120 "K-quant matvec by rows per CTA (the AR step's shapes, n 1 and 8), the verify by K split (n 16, 23, 64, 512)" \
    python3 bench/gpu_bench.py matvec --out "$PARTS/matvec.json"
  run 120 "matmul table (every format, exact and float kernels; n 1..512, ffn shapes)" python3 bench/gpu_bench.py matmul --out "$PARTS/matmul.json"
}

record() {
  step "record"
  [ $DRY = 1 ] && { echo "(dry run) python3 bench/gpu_bench.py record --parts $PARTS --commit \$COMMIT"; return 0; }
  local out
  # the table goes to the console; `tee /dev/stderr` would reopen a redirected log file and write over it
  local table
  table=$(python3 bench/gpu_bench.py record --parts "$PARTS" --commit "$COMMIT")
  printf '%s\n' "$table"
  out=$(printf '%s\n' "$table" | sed -n 's/^wrote //p' | head -1)
  if [ -n "${OUT:-}" ] && [ -n "$out" ]; then
    cp "$out" "${out%.json}.md" "$OUT"/
  fi
  save_logs
}

main() {
  step "gpu_bench.sh $PART (arch $ARCH, commit ${COMMIT:-from .gpu/commit}$([ "$BUDGET" -gt 0 ] && echo ", budget ${BUDGET}s"))"
  setup_env || return 1
  saving_logs_every 20
  case $PART in
    part1) part1 ;;
    part2) part2; record ;;
    part3) part3; record ;;
    all) part1; part2; part3; record ;;
    first) part1; part2_short; record ;;
  esac
  [ -z "$SAVER" ] || kill "$SAVER" 2>/dev/null
  save_logs
  echo
  [ $status = 0 ] && echo "gpu_bench $PART: OK" || echo "gpu_bench $PART: FAILED (see the steps above)"
  return $status
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0
parse_args "$@"
mkdir -p build
# the console log goes to $OUT line by line, so a call killed at its limit still brings it back
LOGS=("build/gpu_bench-$PART.log")
[ -n "${OUT:-}" ] && [ $DRY = 0 ] && LOGS+=("$OUT/gpu_bench-$PART.log")
main 2>&1 | tee "${LOGS[@]}"
exit "${PIPESTATUS[0]}"
