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
