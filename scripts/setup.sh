#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
# torch goes first, pinned to 2.13.0: a looser requirement could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/python -m pip install -q --no-deps mindformers==2.1.0
# DeepSpeed's own config check for `map-args --to deepspeed` (tests): the CPU build, no native ops.
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-deps --no-build-isolation deepspeed==0.19.8 hjson py-cpuinfo msgpack einops
