#!/usr/bin/env bash
# Make the venv that holds llama.cpp (llama-cpp-python, built from source for this CPU), the peer
# of the CPU benchmarks for one stream, and the GGUF files it is measured on. It is never a
# dependency of the package, its tests or CI. Idempotent: each step is skipped when already done.
#
#   ./benchmarks/setup_llama_cpp.sh     # venv in benchmarks/.llama-venv (or $LLAMA_VENV),
#                                       # GGUF files in benchmarks/.gguf (or $GGUF_DIR)
#
# What it does, and why:
#   1. python -m venv (python3.11 by default; $PYTHON to choose another)
#   2. pip install llama-cpp-python==$LLAMA_CPP_VERSION (0.3.36) from its sdist, with
#      GGML_NATIVE=ON so that ggml uses every vector extension this CPU has (AVX2, AVX-512,
#      AVX512-BF16...), as a user building it on their machine gets. About 25 minutes on 2 cores;
#      once per machine (a CPU of another kind needs a rebuild: `rm -rf` the venv).
#   3. The GGUF files of the bundled model: Q4_1 is the file the wheel ships (used as it is);
#      F32, F16 and Q8_0 are made from the model's float32 Hugging Face folder (the conversion
#      this project caches) with llama.cpp's own converter, convert_hf_to_gguf.py from the same
#      sdist, run with this project's python (it needs torch and transformers), the sdist's own
#      gguf-py, and sentencepiece (which the converter imports before it looks for a
#      tokenizer.model) installed into a folder of its own, not into this project's environment.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${LLAMA_VENV:-$HERE/.llama-venv}"
GGUF_DIR="${GGUF_DIR:-$HERE/.gguf}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
SRC="$HERE/.llama-src"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_llama_cpp] creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PY="$VENV/bin/python"

# The sdist, unpacked once: it is what pip builds and where the converter comes from.
if [ ! -f "$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    echo "[setup_llama_cpp] downloading the llama-cpp-python $VERSION sdist"
    mkdir -p "$SRC"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
    tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
fi
LLAMA_CPP="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"

installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
if [ "$installed" != "$VERSION" ]; then
    echo "[setup_llama_cpp] building llama-cpp-python $VERSION from source (about 25 minutes on 2 cores)"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$PY" -m pip install --no-cache-dir "$SRC/llama_cpp_python-$VERSION.tar.gz"
else
    echo "[setup_llama_cpp] llama-cpp-python $VERSION already installed"
fi

mkdir -p "$GGUF_DIR"
SHIPPED="$(python3 -c 'from compiled_llm.bundled_model import bundled_gguf_path; print(bundled_gguf_path())')"
ln -sf "$SHIPPED" "$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_DEPS="$SRC/converter-deps"
if [ ! -d "$CONVERTER_DEPS/sentencepiece" ]; then
    python3 -m pip install --quiet --target "$CONVERTER_DEPS" sentencepiece
fi
HF_DIR="$(python3 -c 'from compiled_llm.bundled_model import bundled_model_path; print(bundled_model_path())')"
for outtype in f32 f16 q8_0; do
    name="SmolLM2-135M-Instruct.$(echo "$outtype" | tr '[:lower:]' '[:upper:]').gguf"
    if [ ! -s "$GGUF_DIR/$name" ]; then
        echo "[setup_llama_cpp] converting $HF_DIR to $name with llama.cpp's converter"
        PYTHONPATH="$CONVERTER_DEPS" python3 "$LLAMA_CPP/convert_hf_to_gguf.py" "$HF_DIR" --outtype "$outtype" --outfile "$GGUF_DIR/$name.tmp"
        mv "$GGUF_DIR/$name.tmp" "$GGUF_DIR/$name"
    fi
done

echo "[setup_llama_cpp] checking: import llama_cpp"
"$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__); print(llama_cpp.llama_print_system_info().decode())'
ls -la "$GGUF_DIR"
echo "[setup_llama_cpp] ready: $PY, GGUF files in $GGUF_DIR"
