#!/usr/bin/env bash
# One prepared GPU check (issue 5), meant to finish in well under 8 minutes on an H200:
#   1. the `cuda`-marked tests (CUDA-graph wrapper, Triton kernels on the GPU, -O2 end to end);
#   2. benchmarks/gpu_decode.py: decode tok/s and ITL, eager vs -O1 vs -O2 vs HF transformers,
#      batch 1/8/64, medians of 3 runs;
#   3. benchmarks/gpu_serve.py: `compiled-llm serve` with its GPU defaults under streaming clients.
# GPU_CHECK_STEPS picks steps (default "tests decode serve").
# Results go under $OUT when set (the device tool), else ./gpu_check_out. On a machine without
# a GPU it runs too: the cuda tests skip and the benchmark runs a CPU smoke version.
# The GPU image lacks msgspec, pyzmq and the server's packages: run benchmarks/fetch_gpu_wheels.sh
# here first, then call the device tool with carry: [".whl"] (.whl/ is git-ignored and does not
# travel otherwise), e.g.  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import msgspec, zmq, fastapi, uvicorn, setproctitle" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # run from the source tree, no install
export COMPILED_LLM_CACHE="${COMPILED_LLM_CACHE:-/tmp/compiled-llm-cache}"
export PYTHONUNBUFFERED=1
export COMPILED_LLM_DISABLE_CPU_KERNELS=1  # no C++ CPU-kernel build there: the GPU run needs none
{
  date
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
steps="${GPU_CHECK_STEPS:-tests decode serve}"
if [[ " $steps " == *" tests "* ]]; then
  # Only the folders with cuda tests: the server tests need the openai client, which the image lacks.
  timeout 270 python3 -m pytest -q -rfE --tb=short -m cuda -p no:cacheprovider tests/compilation tests/kernels tests/worker 2>&1 | tee "$OUT/cuda_tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $steps " == *" decode "* ]]; then
  timeout 240 python3 benchmarks/gpu_decode.py --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [[ " $steps " == *" serve "* ]]; then
  timeout 200 python3 benchmarks/gpu_serve.py --json "$OUT/serve.json" --server-log "$OUT/server.log" 2>&1 | tee "$OUT/serve.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_check: exit $status; results in $OUT"
exit "$status"
