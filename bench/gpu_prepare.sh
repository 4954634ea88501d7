#!/usr/bin/env bash
# gpu_prepare.sh — run HERE (a machine with network), before asking for GPU time: puts in .gpu/ (git-ignored)
# everything bench/gpu_bench.sh needs on a bare GPU machine with no network:
#   .gpu/whl/                 the wheels listed in bench/gpu_wheels.txt (Python 3.12, manylinux x86-64)
#   .gpu/llamacpp-src.tar.gz  llama.cpp's source, made by ../shared/peer/llamacpp_src.sh (kept if present);
#                             bench/gpu_llamacpp.sh builds it there
#   .gpu/commit               the HEAD the record will name
# Then call the device tool with carry [".gpu"] and the commands it prints.
# Usage: bash bench/gpu_prepare.sh [--check]     (--check: only verify .gpu/ is complete, download nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_DIR:-.gpu}
SHARED=${SHARED:-../shared}
check_only=0
case "${1:-}" in
  "") ;;
  --check) check_only=1 ;;
  -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
  *) echo "gpu_prepare.sh: unknown argument '$1' (use --check or nothing)" >&2; exit 2 ;;
esac
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
git rev-parse HEAD > $DIR/commit
echo "$DIR: $(du -sh $DIR | cut -f1) ($(ls $DIR/whl | wc -l) wheels); commit $(cat $DIR/commit)"
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "warning: uncommitted changes: the record will name $(cat $DIR/commit) but measure the working tree"
echo "device tool, carry [\"$DIR\"]; with 15 minutes of device time, ONE call with timeout_s 600:"
echo "  bash bench/gpu_bench.sh first        (part1, a short part2, the record: 540 s budget)"
echo "with 30 minutes or more, three calls back to back (the machine stays warm 30 s):"
echo "  bash bench/gpu_bench.sh part1"
echo "  bash bench/gpu_bench.sh part2"
echo "  bash bench/gpu_bench.sh part3"
