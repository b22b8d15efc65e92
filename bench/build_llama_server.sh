#!/usr/bin/env bash
# Build llama.cpp's own `llama-server` (the CPU peer `pdserve bench` is compared against) once
# per machine and cache the binary under ~/.cache/pdserve/llama-server/ (or
# $XDG_CACHE_HOME/pdserve/llama-server/). Follows /work/shared/NOTES.md ("llama.cpp's own server"):
# the llama.cpp tree vendored in the sdist of llama-cpp-python 0.3.36, GGML_NATIVE off (a native
# build dies with SIGILL at an AMX instruction on these VMs), AMX off, and every other ISA
# extension on exactly when /proc/cpuinfo lists it (an AVX-VNNI build died with SIGILL, -4, on
# an AMD EPYC VM with avx512_vnni but no avx_vnni).
# Prints the binary's path on stdout when done; a second run reuses the cached binary.
# Usage: nice -n 19 bench/build_llama_server.sh [JOBS]      (JOBS: cmake -j, default 2)
set -euo pipefail
VERSION=0.3.36
JOBS="${1:-2}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/llama-server"
HOST_KEY="$(uname -m)-$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //; s/[^A-Za-z0-9]/_/g')"
OUT="$CACHE/$HOST_KEY"
FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | sed 's/.*: //') "
has() { [[ "$FLAGS" == *" $1 "* ]] && echo ON || echo OFF; }
ISA=(-DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
     -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
     -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
     -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)")
BIN="$OUT/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$OUT"
WORK="$(mktemp -d "$CACHE/.build-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "build_llama_server: fetching the llama-cpp-python $VERSION sdist into $WORK" >&2
python3 -m pip download --no-deps --no-binary :all: --disable-pip-version-check \
  -d "$WORK" "llama-cpp-python==$VERSION" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no llama.cpp tree at $SRC" >&2; exit 1; }
echo "build_llama_server: configuring $SRC with ${ISA[*]}" >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF "${ISA[@]}" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF >&2
echo "build_llama_server: building llama-server (-j$JOBS; about 10 minutes on 2 cores)" >&2
cmake --build "$WORK/build" -j"$JOBS" --target llama-server >&2
cp "$WORK/build/bin/llama-server" "$BIN.part"
mv "$BIN.part" "$BIN"
"$BIN" --version >&2 || true
echo "$BIN"
