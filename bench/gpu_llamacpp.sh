#!/usr/bin/env bash
# gpu_llamacpp.sh — on the GPU machine: llama.cpp's llama-bench built with CUDA, the peer our record measures
# against, from the source tarball bench/gpu_prepare.sh carries. It first checks that the toolkit has what
# ggml-cuda links, so a missing piece costs seconds and is named, not found minutes into a configure:
#   cuBLAS (always linked)   the toolkit's own, else the nvidia-cublas wheel's (then named to CMake explicitly)
#   libcuda.so (the stub)    only for the virtual-memory pool; without it the build drops that pool
#                            (-DGGML_CUDA_NO_VMM=ON: an allocator detail, the kernels are the same)
# Usage: gpu_llamacpp.sh SRC.tar.gz BUILD_DIR [ARCH=90]
# Environment: CUDA_ROOT (default: the folder above nvcc's bin/), PYTHON (default python3).
# Writes BUILD_DIR/toolkit.json (what was found, the flags chosen), BUILD_DIR/{configure,build}.log, whole.
# Exit: 0 built; 3 no cuBLAS anywhere (nothing configured); 1 configure or build failed.
set -uo pipefail
tarball=$(realpath "${1:?usage: gpu_llamacpp.sh SRC.tar.gz BUILD_DIR [ARCH]}")
build=$(realpath -m "${2:?usage: gpu_llamacpp.sh SRC.tar.gz BUILD_DIR [ARCH]}")
arch=${3:-90}
PYTHON=${PYTHON:-python3}
mkdir -p "$build"

nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
root=${CUDA_ROOT:-$(dirname "$(dirname "$nvcc_bin")")}
# first file matching a pattern under the toolkit's usual library folders, or nothing
find_lib() {
  local pat=$1 d
  for d in "$root/lib64" "$root/lib" "$root/targets/x86_64-linux/lib" "$root/targets/sbsa-linux/lib"; do
    compgen -G "$d/$pat" > /dev/null && { compgen -G "$d/$pat" | head -1; return 0; }
  done
  return 1
}

cublas=$(find_lib 'libcublas.so*') || cublas=
cublas_src=toolkit
extra=()
if [ -z "$cublas" ]; then
  # the nvidia-cublas wheel (PyTorch's images carry it): its lib/ and include/
  wheel=$("$PYTHON" -c 'import nvidia.cublas as m; print(list(m.__path__)[0])' 2>/dev/null) || wheel=
  lib=$(compgen -G "$wheel/lib/libcublas.so*" | head -1)
  lt=$(compgen -G "$wheel/lib/libcublasLt.so*" | head -1)
  if [ -n "$wheel" ] && [ -n "$lib" ] && [ -n "$lt" ] && [ -f "$wheel/include/cublas_v2.h" ]; then
    cublas=$lib
    cublas_src=wheel
    extra+=(-DCUDA_cublas_LIBRARY="$lib" -DCUDA_cublasLt_LIBRARY="$lt"
            -DCMAKE_CUDA_FLAGS="-I$wheel/include" -DCMAKE_CXX_FLAGS="-I$wheel/include")
  fi
fi
stub=$(find_lib 'stubs/libcuda.so') || stub=
[ -n "$stub" ] || extra+=(-DGGML_CUDA_NO_VMM=ON)

jstr() { if [ -n "$1" ]; then printf '"%s"' "$1"; else printf null; fi; }
printf '{"cuda_root": %s, "cublas": %s, "cublas_from": "%s", "libcuda_stub": %s, "no_vmm": %s}\n' \
  "$(jstr "$root")" "$(jstr "$cublas")" "$([ -n "$cublas" ] && echo "$cublas_src" || echo none)" "$(jstr "$stub")" \
  "$([ -n "$stub" ] && echo false || echo true)" > "$build/toolkit.json"
echo "toolkit: $(tr -d '\n' < "$build/toolkit.json")"
if [ -z "$cublas" ]; then
  echo "llama.cpp not built: no cuBLAS in $root nor in an nvidia-cublas wheel (ggml-cuda links it)"
  exit 3
fi

mkdir -p "$build/src"
tar -xzf "$tarball" -C "$build/src" || { echo "cannot unpack $tarball"; exit 1; }
gen=()
command -v ninja > /dev/null && gen=(-G Ninja)
if ! cmake -S "$build/src/llama.cpp" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
    "${extra[@]}" > "$build/configure.log" 2>&1; then
  echo "llama.cpp configure failed:"; tail -30 "$build/configure.log"; exit 1
fi
if ! cmake --build "$build" --target llama-bench -j "$(nproc)" > "$build/build.log" 2>&1; then
  echo "llama.cpp build failed:"; grep -m 20 -E "error|Error" "$build/build.log"; tail -10 "$build/build.log"; exit 1
fi
echo "built $build/bin/llama-bench"
