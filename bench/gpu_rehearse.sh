#!/usr/bin/env bash
# gpu_rehearse.sh — runs, for real and without a GPU, the steps of bench/gpu_bench.sh that need none, through the
# script's own functions (run under timeout, the background jobs, save_logs, record): the build step on the sm_90
# library gpu_prepare.sh built here (it must be current: the device builds nothing then; its device check then
# says no GPU), llama.cpp's toolkit check, the exactness, slots and drafters parts with the CPU
# standing in (and the drafters part's `synth --mtp` writer as a background job, on the tiny shape), the
# test summary and the record, with OUT set.  --dry-run never calls timeout or the build; this does, so a script
# error is found here, not on a lent GPU.  Needs nvcc and the .gpu/ llama.cpp tarball (bench/gpu_prepare.sh).
# Usage: bash bench/gpu_rehearse.sh [OUT_DIR]      (leaves build/gpu*, build/llamacpp*; writes no bench/results file)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tarball=$PWD/.gpu/llamacpp-src.tar.gz
[ -s "$tarball" ] || { echo "gpu_rehearse.sh: run bench/gpu_prepare.sh first (no $tarball)" >&2; exit 2; }
out=${1:-$(mktemp -d)}
mkdir -p "$out" && out=$(realpath "$out")
source bench/gpu_bench.sh
# the carried wheels are for the GPU image's Python: this machine's own packages stand in
GPU=$(mktemp -d); export GPU
ln -s "$tarball" "$GPU/llamacpp-src.tar.gz"
prebuilt=$PWD/.gpu/prebuilt-sm$ARCH
[ "$(cat "$prebuilt/source.sha256" 2>/dev/null)" = "$(source_hash)" ] ||
  { echo "REHEARSAL FAILED: $prebuilt is missing or not built from these sources: run bench/gpu_prepare.sh"; exit 1; }
ln -s "$prebuilt" "$GPU/prebuilt-sm$ARCH"
OUT=$out; export OUT
BUDGET=600; T0=$SECONDS
command -v nvcc > /dev/null || export PATH=/usr/local/cuda/bin:$PATH
rm -rf build/gpu-parts build/llamacpp build/llamacpp.done
setup_env || exit 1
before=$(ls bench/results/)
background llamacpp nice -n 10 bash bench/gpu_llamacpp.sh "$GPU/llamacpp-src.tar.gz" build/llamacpp "$ARCH"
rm -f build/gpu/libdflash27b.so build/gpu/dfl_backend_ops
# the device must not compile: here a compile is a failure, marked where the build step would start one
compile_ours() { echo "REHEARSAL: the build step tried to compile"; return 1; }
run 300 "build (sm_$ARCH)" build_ours | tee build/rehearse-build.log
build_rc=${PIPESTATUS[0]}
grep -q "REHEARSAL: the build step tried to compile" build/rehearse-build.log &&
  { echo "REHEARSAL FAILED: the build step compiled instead of taking the prebuilt library"; exit 1; }
grep -q "prebuilt library for sm_$ARCH" build/rehearse-build.log && [ -f build/gpu/libdflash27b.so ] &&
  [ -x build/gpu/dfl_backend_ops ] || { echo "REHEARSAL FAILED: the build step did not take the prebuilt library"; exit 1; }
wait_for llamacpp 120
[ "$(cat build/llamacpp.done 2>/dev/null)" = 3 ] || [ "$(cat build/llamacpp.done 2>/dev/null)" = 0 ] ||
  { echo "REHEARSAL FAILED: llama.cpp's build script"; cat build/llamacpp.log; exit 1; }
run 120 "exactness (the CPU stands in)" python3 bench/gpu_bench.py exact --device cpu --n-new 16 \
  --out "$PARTS/exact.json" || { echo "REHEARSAL FAILED: exact"; exit 1; }
run 120 "slots (the CPU stands in)" python3 bench/gpu_bench.py slots --device cpu -n 16 --slots 3 --ctx 512 \
  --out "$PARTS/slots.json" || { echo "REHEARSAL FAILED: slots"; exit 1; }
# the drafters part's writer (part3 writes the 27B so, in the background) on the tiny shape, then the part
background synth27mtp python3 -m dflash27b.cli synth build/rehearse-mtp.gguf --shape tiny --ftype q4_k_m --mtp
wait_for synth27mtp 60 || { echo "REHEARSAL FAILED: synth --mtp"; exit 1; }
run 120 "drafters (the CPU stands in)" python3 bench/gpu_bench.py drafters --device cpu -n 16 --ctx 512 \
  --out "$PARTS/drafters.json" || { echo "REHEARSAL FAILED: drafters"; exit 1; }
rm -f build/rehearse-mtp.gguf build/synth27mtp.log build/synth27mtp.done
checks_summary
record
for f in bench/results/gpu-*; do  # the record of this rehearsal only (a CPU stood in): not a result
  grep -qx "$(basename "$f")" <<< "$before" || rm -f "$f"
done
[ -s "$OUT/gpu-logs.tar.gz" ] && ls "$OUT"/gpu-*.json > /dev/null 2>&1 || { echo "REHEARSAL FAILED: nothing in OUT"; exit 1; }
echo "rehearsal OK (build step exit $build_rc: the prebuilt library, no GPU visible); OUT: $OUT"
