#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels the GPU machine's image lacks (msgspec, pyzmq, and
# for the server FastAPI, Starlette, pydantic, uvicorn and setproctitle),
# for Python 3.12 on x86-64: the device tool carries them (`carry: [".whl"]`) and
# benchmarks/gpu_check.sh installs them into /tmp/site there. Run it here, before the GPU run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .whl msgspec==0.23.0 pyzmq==27.3.0 setproctitle==1.3.8 pydantic_core==2.46.4 uvloop==0.23.0 httptools==0.9.0
# Pure-Python wheels (their own dependencies are in the image: anyio, click, h11, annotated-doc).
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl fastapi==0.165.0 starlette==1.10.0 \
  pydantic==2.13.4 annotated-types==0.7.0 typing-inspection==0.4.2 uvicorn==0.54.0 opentelemetry-api==1.45.2 \
  typing-extensions==4.16.0  # pydantic needs >= 4.14.1; the image's may be older
ls -la .whl
