#!/usr/bin/env bash
# Build llama.cpp's command-line tools for `make eval-engines`. There is no llama.cpp wheel or
# Debian package here, but the llama-cpp-python sdist vendors llama.cpp's whole CMake tree, so we
# fetch that sdist through pip (the configured package index) and build only the tools we run.
# ~11 minutes on 2 cores; skipped when the binaries already exist.
set -euo pipefail
DEST=${1:-.llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
# Plain decoding is llama-completion in recent builds (llama-cli became an interactive chat there);
# older builds only have llama-cli. Both are tried; at least one must come out.
TOOLS="llama-speculative-simple llama-bench"

built() {
    for tool in $TOOLS; do [ -x "$DEST/bin/$tool" ] || return 1; done
    [ -x "$DEST/bin/llama-completion" ] || [ -x "$DEST/bin/llama-cli" ]
}
if built; then echo "llama.cpp tools already built in $DEST/bin"; exit 0; fi

for cmd in cmake ninja; do
    command -v "$cmd" >/dev/null || { echo "error: $cmd not found (apt-get install $cmd, or pip install $cmd)"; exit 1; }
done

mkdir -p "$DEST/src"
if [ ! -d "$DEST/src/llama_cpp_python-$VERSION" ]; then
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$DEST/src" "llama-cpp-python==$VERSION"
    tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
fi
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"

# Built for this CPU (GGML_NATIVE), but without Intel AMX unless LLAMACPP_AMX=1: on this project's VMs
# cpuid lists AMX, yet ggml's AMX kernels (used for Q4_0/Q4_1/Q8_0/K-quant weights) died with SIGILL
# at their first tile instruction; f16 weights never use them.
EXTRA_FLAGS=""
if [ "$(uname -m)" = x86_64 ] && [ "${LLAMACPP_AMX:-0}" != 1 ]; then EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$SRC" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$EXTRA_FLAGS" -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
    -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
TARGETS=$(ninja -C "$DEST/build" -t targets all)  # not piped into grep -q: pipefail would see ninja's SIGPIPE
PLAIN=llama-cli
if grep -q '^llama-completion:' <<<"$TARGETS"; then PLAIN=llama-completion; fi
ninja -C "$DEST/build" $PLAIN $TOOLS

mkdir -p "$DEST/bin"
for tool in $PLAIN $TOOLS; do cp "$DEST/build/bin/$tool" "$DEST/bin/"; done
built || { echo "error: llama.cpp tools missing from $DEST/bin after the build"; exit 1; }
echo "llama.cpp tools in $DEST/bin: $(ls "$DEST/bin" | tr '\n' ' ')"
