#!/usr/bin/env bash
# gpu_prepare.sh — run HERE (a machine with network), before asking for GPU time: puts in .gpu/ (git-ignored)
# everything bench/gpu_bench.sh needs on a bare GPU machine with no network:
#   .gpu/whl/                 the wheels listed in bench/gpu_wheels.txt (Python 3.12, manylinux x86-64)
#   .gpu/llamacpp-src.tar.gz  llama.cpp's source, made by ../shared/peer/llamacpp_src.sh (kept if present);
#                             bench/gpu_llamacpp.sh builds it there
#   .gpu/prebuilt-sm90/       our library and backend op test (xz) built HERE for sm_90 (H100 / H200) with
#                             bench/gpu_bench.sh's own build, and the digest of the sources they were built from:
#                             gpu_bench.sh uses them when the sources it runs on have that digest, so the device's
#                             minutes go to measuring (nvcc on backend.cu alone outran a 300 s step on an H200 host).
#                             about 2 minutes on 2 cores; kept while the sources do not change
#   .gpu/commit               the HEAD the record will name
# Then call the device tool with carry [".gpu"] and the commands it prints.
# Usage: bash bench/gpu_prepare.sh [--check | --no-build]
#   --check: only verify .gpu/ is complete (the prebuilt library current), download and build nothing
#   --no-build: everything but the prebuilt library (the device then builds: about a minute of its time)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_DIR:-.gpu}
SHARED=${SHARED:-../shared}
check_only=0
prebuild=1
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  --no-build) prebuild=0 ;;
  -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
  *) echo "gpu_prepare.sh: unknown argument '$1' (use --check, --no-build or nothing)" >&2; exit 2 ;;
esac
source bench/gpu_bench.sh  # its functions only (source_hash, compile_ours); ARCH 90
PREBUILT=$DIR/prebuilt-sm$ARCH
prebuilt_current() {
  [ -s "$PREBUILT/libdflash27b.so.xz" ] && [ -s "$PREBUILT/dfl_backend_ops.xz" ] &&
    [ "$(cat "$PREBUILT/source.sha256" 2>/dev/null)" = "$(source_hash)" ]
}
# sends_fit: what a device call sends (the tracked and untracked-not-ignored files, and $DIR, which carry names)
# fits the device tool's 64 MiB
sends_fit() {
  local bytes
  bytes=$( { git ls-files -z --cached --others --exclude-standard; find "$DIR" -type f -print0; } |
           xargs -0 -r stat -L -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
  echo "a device call sends $((bytes / 1048576)) MiB (the tree and $DIR; the limit is 64 MiB)"
  [ "$bytes" -le $((64 * 1048576)) ] || { echo "over the device tool's 64 MiB: carry less"; return 1; }
}
mapfile -t WHEELS < <(grep -v '^\s*#' bench/gpu_wheels.txt | grep -v '^\s*$')

missing=()
for w in "${WHEELS[@]}"; do
  name=${w%%==*}; ver=${w#*==}
  ls "$DIR"/whl/"${name//-/_}"-"$ver"-*.whl >/dev/null 2>&1 || missing+=("$w")
done
if [ $check_only = 1 ]; then
  ok=1
  [ ${#missing[@]} = 0 ] || { echo "missing wheels: ${missing[*]}"; ok=0; }
  [ -s $DIR/llamacpp-src.tar.gz ] || { echo "missing $DIR/llamacpp-src.tar.gz"; ok=0; }
  prebuilt_current || echo "no current prebuilt library ($PREBUILT): the device will build (a minute of its time)"
  sends_fit || ok=0
  [ $ok = 1 ] && echo "$DIR is complete ($(du -sh $DIR | cut -f1))"
  [ $ok = 1 ]; exit
fi

mkdir -p $DIR/whl
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $DIR/whl "${missing[@]}"
fi
[ -s $DIR/llamacpp-src.tar.gz ] || bash "$SHARED/peer/llamacpp_src.sh" $DIR/llamacpp-src.tar.gz
if [ $prebuild = 1 ]; then
  if prebuilt_current; then
    echo "$PREBUILT: current (sources $(source_hash))"
  else
    command -v nvcc > /dev/null || export PATH=/usr/local/cuda/bin:$PATH
    echo "building the sm_$ARCH library here (build/gpu, log build/gpu.build.log): about 2 minutes on 2 cores, longer when a CI-like build shares them"
    hash=$(source_hash)
    start=$SECONDS
    mkdir -p build && compile_ours || { echo "gpu_prepare.sh: the sm_$ARCH build failed" >&2; exit 1; }
    [ "$(source_hash)" = "$hash" ] || { echo "gpu_prepare.sh: the sources changed during the build; run it again" >&2; exit 1; }
    rm -rf "$PREBUILT" && mkdir -p "$PREBUILT"
    for f in libdflash27b.so dfl_backend_ops; do xz -T0 -6 -c "build/gpu/$f" > "$PREBUILT/$f.xz"; done
    echo "$hash" > "$PREBUILT/source.sha256"
    echo "$PREBUILT: built in $((SECONDS - start)) s (sources $hash, $(du -sh "$PREBUILT" | cut -f1))"
    # the slowest objects (ninja's log, the newest entry of each): one nvcc process is what a fallback build on the
    # device waits for, under a 300 s step (backend.cu took 384 s alone once); warn well before
    if [ -f build/gpu/.ninja_log ]; then
      awk -F'\t' 'NR > 1 { t[$4] = ($2 - $1) / 1000 } END { for (o in t) printf "%.0f %s\n", t[o], o }' \
        build/gpu/.ninja_log | sort -rn | head -3 | while read -r secs obj; do
          echo "  ${secs} s  $obj"
          [ "$secs" -lt 150 ] || echo "  warning: over 150 s for one object here: a build on the device would be close to its 300 s step"
        done
    fi
  fi
fi
git rev-parse HEAD > $DIR/commit
sends_fit || exit 1
echo "$DIR: $(du -sh $DIR | cut -f1) ($(ls $DIR/whl | wc -l) wheels); commit $(cat $DIR/commit)"
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "warning: uncommitted changes: the record will name $(cat $DIR/commit) but measure the working tree"
echo "device tool, carry [\"$DIR\"]; with 15 minutes of device time, ONE call with timeout_s 600:"
echo "  bash bench/gpu_bench.sh first        (part1, a short part2, the record: 540 s budget)"
echo "with 30 minutes or more, three calls back to back (the machine stays warm 30 s):"
echo "  bash bench/gpu_bench.sh part1"
echo "  bash bench/gpu_bench.sh part2"
echo "  bash bench/gpu_bench.sh part3"
