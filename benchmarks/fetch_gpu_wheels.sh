#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels the GPU machine's image lacks (msgspec, pyzmq),
# for Python 3.12 on x86-64: the device tool carries them (`carry: [".whl"]`) and
# benchmarks/gpu_check.sh installs them into /tmp/site there. Run it here, before the GPU run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl msgspec==0.23.0 pyzmq==27.3.0
ls -la .whl
