#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-server and libllama.so for the CPU this runs on (every
# x86 extension /proc/cpuinfo reports, AMX off), from the llama.cpp tree vendored in the
# llama-cpp-python sdist, into ROOT/<key of the version and CPU flags>. Prints the bin directory
# last: run the binaries with LD_LIBRARY_PATH set to it, or point llama-cpp-python at it with
# LLAMA_CPP_LIB_PATH. A second run with the same CPU and version only prints the directory.
# Usage: benchmarks/llama_native.sh [ROOT]   (default ~/.cache/llama-native)
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
on() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
root=${1:-$HOME/.cache/llama-native}
out=$root/$(echo "$version $flags" | sha1sum | cut -c1-10)
bin=$out/src/build/bin
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-server" ] && [ -e "$bin/libllama.so" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$out"
if [ ! -d "$out/src" ]; then
  scratch=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$scratch" "llama-cpp-python==$version" >&2
  tar xzf "$scratch"/llama_cpp_python-*.tar.gz -C "$scratch"
  mv "$scratch"/llama_cpp_python-*/vendor/llama.cpp "$out/src"
  rm -rf "$scratch"
fi
cd "$out/src"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c) \
  -DGGML_BMI2=$(on bmi2) -DGGML_AVX_VNNI=$(on avx_vnni) -DGGML_AVX512=$(on avx512f) \
  -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni) \
  -DGGML_AVX512_BF16=$(on avx512_bf16) \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >&2
cmake --build build -j"$(nproc)" --target llama-bench llama-server llama >&2
echo "$bin"
