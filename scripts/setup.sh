#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv.
# torch goes first, pinned to 2.13.0: a looser requirement could pull a multi-GB CUDA build.
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
# MindFormers 2.1.0, the oracle of tests/test_mindspore_mindformers.py (its Llama model and converter)
# and of the map-args loader tests (MindFormerConfig), without its dependency list (which pins a
# numpy>=2 stack and NPU tooling): only what importing mindformers.models.llama needs on CPU with
# mindspore 2.10 / numpy<2 (pyarrow<20 and pandas<2.3 still support numpy 1.x).
echo "setup: installing MindFormers 2.1.0 (no dependencies) and the few packages its Llama import needs"
.venv/bin/python -m pip install --disable-pip-version-check --no-deps mindformers==2.1.0 \
    deprecated==1.3.1 wrapt==2.5.2 requests==2.34.2 urllib3==2.8.0 certifi==2026.10.18 jieba==0.42.1 \
    rouge-chinese==1.0.3 datasets==5.2.0 multiprocess==0.70.19 pandas==2.2.3 pytz==2026.6 tzdata==2026.6 \
    pyarrow==19.0.1 xxhash==4.1.0 sentencepiece==0.2.3 tiktoken==0.14.0 mindpet==1.0.4 tensorboardX==2.6.5
# DeepSpeed's own config check for `map-args --to deepspeed` (tests): the CPU build, no native ops.
echo "setup: installing DeepSpeed 0.19.8 (CPU build, no native ops)"
DS_BUILD_OPS=0 .venv/bin/python -m pip install --disable-pip-version-check --no-deps --no-build-isolation \
    deepspeed==0.19.8 hjson py-cpuinfo msgpack einops
# ColossalAI's own config loader (colossalai.context.Config) for `map-args --to colossalai` (tests) and its
# checkpoint IO (tests: its load_model reads model.pt; the FSDP2 load of the DCP target); no dependencies but peft,
# which its checkpoint IO imports, and accelerate, which peft imports.
echo "setup: installing ColossalAI 0.5.0 (its config loader and checkpoint IO, no dependencies), peft and accelerate"
.venv/bin/python -m pip install --disable-pip-version-check --no-deps colossalai==0.5.0 peft==0.21.2 accelerate==1.15.0
echo "setup: done (.venv/bin/interop --help)"
