#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
# torch goes first, pinned to 2.13.0: a looser requirement could pull a multi-GB CUDA build.
# Each stage says what it does, and pip shows what it downloads (a fresh setup takes a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
fi
echo "setup: installing torch 2.13.0 (CPU build)"
.venv/bin/python -m pip install --disable-pip-version-check torch==2.13.0
echo "setup: installing interop with its test extras (transformers, mindspore, megatron-core, ...)"
.venv/bin/python -m pip install --disable-pip-version-check -e ".[test]"
echo "setup: done (.venv/bin/interop --help)"
