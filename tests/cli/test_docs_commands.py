"""Every command in README.md and docs/ (their ```bash blocks): each `interop ...` line parses with the CLI as it
is (no removed command, option or choice), and runs, with its own arguments, on tiny models and the real tools'
fixtures laid out under the names the docs use (issue 27 item 14: `test_every_documented_command_runs`); the
README's first conversion also from a shell, exactly as written; every file the docs link to exists (issue 23)."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from interop.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    """The `interop ...` commands of a block, comments dropped ([...] marks optional flags in a synopsis: dropped)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():  # a line continued with a backslash is one command
        line = line.split("  #")[0].split(" # ")[0].strip()
        if line.startswith("interop "):
            out.append(re.sub(r"\s*\[[^\]]*\]", "", line))
    return out


ALL = [(page.relative_to(ROOT).as_posix(), cmd) for page in PAGES for block in bash_blocks(page) for cmd in commands(block)]


def test_the_docs_have_commands():
    assert len(ALL) >= 25 and {page for page, _ in ALL} >= {"README.md", "docs/hf.md", "docs/megatron.md",
                                                            "docs/mindspore.md", "docs/map-args.md", "docs/training.md"}


@pytest.mark.parametrize("page,command", ALL, ids=[f"{p}:{c[:60]}" for p, c in ALL])
def test_every_documented_command_parses(page, command):
    """click parses the command line as the shell would hand it over (paths need not exist for that)."""
    argv = shlex.split(command)[1:]
    while argv and argv[0].startswith("-"):  # the group's own options (-v)
        argv.pop(0)
    ctx = click.Context(main, info_name="interop")
    sub = main.get_command(ctx, argv[0])
    assert sub is not None, f"{page}: `{command}`: no command {argv[0]!r}"
    try:
        sub.make_context(argv[0], argv[1:], parent=ctx)
    except click.UsageError as exc:
        pytest.fail(f"{page}: `{command}`: {exc.format_message()}")


def test_the_first_conversion_runs_as_written(tmp_path):
    """README's "The first conversion" block, line by line in a folder holding ./llama-hf (weights + tokenizer)."""
    from helpers.hf_models import save
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    save("llama", tmp_path / "llama-hf")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 250)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "llama-hf")
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## The first conversion"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = commands(block)
    assert len(lines) == 3
    interop = Path(sys.executable).parent / "interop"
    for line in lines:
        run = subprocess.run([str(interop), *shlex.split(line)[1:]], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, f"{line}\n{run.stdout}\n{run.stderr}"
    out = tmp_path / "llama-hf-again"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] == 0 and config["eos_token_id"] == 0  # the tiny model's own (helpers.hf_models)


def test_every_linked_file_exists():
    """Relative links in README.md, docs/, tests/README.md and ARCHITECTURE.md name files of the repository."""
    missing = []
    for page in [*PAGES, ROOT / "tests" / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing


def test_every_cited_test_file_exists():
    """`tests/...py` paths the README, docs and code cite are files of the repository."""
    cited = set()
    for path in [*PAGES, ROOT / "ARCHITECTURE.md", *ROOT.glob("tests/**/*.py"), *ROOT.glob("interop/**/*.py"),
                 *ROOT.glob("converters/**/*.py"), *ROOT.glob("mappings/*.py")]:
        cited |= set(re.findall(r"\btests/[\w/]+\.py\b", path.read_text()))
    assert cited and not sorted(c for c in cited if not (ROOT / c).is_file())


# -- every documented command runs --------------------------------------------------------------------

FIXTURES = ROOT / "tests" / "fixtures"
# a path a command names -> the fixture written by the real tool it stands for (ROOT-relative)
FIXTURE_INPUTS = {"ds-ckpt": "deepspeed", "checkpoint-500": "deepspeed_zero/z2_fp32/checkpoint-2",
                  "pytorch_model_fsdp_0": "fsdp_dcp/pytorch_model_fsdp_0",
                  "pytorch_model_fsdp.bin": "state_dict/fsdp_full/pytorch_model_fsdp.bin",
                  "pretrain_gpt_7B.yaml": "args/seed000_pretrain_gpt_7B.yaml",
                  "streaming_ckpt": "atorch_fsdp/fp32_dp3/streaming_ckpt", "ds3d-ckpt": "atorch_ds3d"}
# `./config.json` beside a single-file or folder source is that source's own description
CONFIG_OF = {"pytorch_model_fsdp_0": "fsdp_dcp/config.json", "pytorch_model_fsdp.bin": "state_dict/fsdp_full/config.json",
             "streaming_ckpt": "atorch_fsdp/fp32_dp3/config.json"}
TINY_SCRIPT = """#!/bin/bash
# the tiny Llama's launch script (Megatron-LM flags)
torchrun --nproc_per_node 8 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
    --num-layers 12 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 \\
    --group-query-attention --num-query-groups 8 --seq-length 32 --max-position-embeddings 64 \\
    --micro-batch-size 1 --global-batch-size 8 --lr 1e-3 --train-iters 100 --lr-decay-style cosine \\
    --untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type rope \\
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --vocab-size 256 --make-vocab-size-divisible-by 1
"""


def _tiny_llama(path: Path) -> None:
    """12 layers (pp 4, pp 3, pp 2 x vpp 2), 8 heads in 8 KV groups and ffn 128 (tp 8), vocab 256 (parity's
    megatron-core counts padded rows in its loss: a multiple of 128); with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=8,
                                      num_hidden_layers=12, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)


@pytest.fixture(scope="module")
def named_inputs(tmp_path_factory):
    """Every input path the documented commands name, made once: tiny models converted by interop, the real
    tools' fixtures, launch scripts."""
    import shutil

    import sentencepiece
    from helpers.deepseek_models import save as save_v3, v3_config
    from helpers.moe_models import hf_model
    from interop.convert import convert

    root = tmp_path_factory.mktemp("docs-inputs")
    _tiny_llama(root / "llama-hf")
    (root / "tokenizer-dir").mkdir()
    for f in (root / "llama-hf").glob("tokenizer*"):
        shutil.copy(f, root / "tokenizer-dir")
    text = root / "text.txt"
    text.write_text("\n".join(f"the tiny model reads line {i} of its text" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(root / "tokenizer"), vocab_size=30,
                                             minloglevel=2)
    for name, fmt, options in (("llama-megatron", "megatron", dict(tp=2, pp=2)),
                               ("megatron-ckpt", "megatron", dict(tp=2, pp=2)),
                               ("ms-ckpt", "mindspore", dict(tp=2)), ("llama-ms", "mindspore", dict(tp=2)),
                               ("ckpt-tp4pp2", "interop", dict(tp=4, pp=2)), ("common", "interop", {}),
                               ("llama2-common", "interop", {})):
        convert(root / "llama-hf", root / name, dst_format=fmt, **options)
    hf_model("mixtral").save_pretrained(root / "mixtral-hf")
    save_v3(v3_config(), root / "v3-source")
    convert(root / "v3-source", root / "DeepSeek-V3", dst_format="hf", dtype="fp8")  # the release's FP8 layout
    convert(root / "DeepSeek-V3", root / "v3-bf16", dst_format="hf")
    (root / "train_llama2.sh").write_text(TINY_SCRIPT)
    (root / "args.txt").write_text(TINY_SCRIPT.split("pretrain_gpt.py \\\n", 1)[1].replace("\\\n", "\n"))
    for name, fixture in FIXTURE_INPUTS.items():
        (root / name).symlink_to(FIXTURES / fixture)
    return root


def _outputs(argv: list[str]) -> set[str]:
    """What a command writes: a conversion's destination, map-args' -o, train's --save (a run resumed is read)."""
    positional = [a for i, a in enumerate(argv[1:], 1) if not a.startswith("-") and not argv[i - 1].startswith("-")]
    if argv[0] == "convert":
        return {positional[1]}
    if argv[0] == "map-args" and "-o" in argv:
        return {argv[argv.index("-o") + 1]}
    if argv[0] == "train" and "--resume" not in argv:
        return {argv[argv.index("--save") + 1]}
    return set()


# Not run yet: the LoRA adapter commands (docs/adapters.md, LoRA training in docs/training.md), whose inputs
# (PEFT adapters, MindSpeed-LLM LoRA checkpoints, a LoRA base) this test does not build yet; each still parses.
NOT_YET = ("./lora-", "./base ", "--adapter ", "--lora-rank")
RUN = [(page, cmd) for k, (page, cmd) in enumerate(ALL)
       if cmd not in [c for _, c in ALL[:k]] and not any(mark in cmd + " " for mark in NOT_YET)]  # once each

# The two commands that take most of the time (measured on 2 cores: parity over four frameworks 62 s, the 100-step
# training run from a YAML 83 s, of 200 s for all) run only with INTEROP_DOC_COMMANDS=all; their capabilities keep
# their own default tests (tests/trainer/). Every other documented command runs by default (about 55 s).
SLOW = ("interop parity ", "interop train --config ")
EVERY = os.environ.get("INTEROP_DOC_COMMANDS") == "all"


def test_every_documented_command_runs(named_inputs, tmp_path, monkeypatch):
    """Each command of README.md and docs/, in page order, with the doc's own arguments, in a folder that holds
    what it reads under the doc's names (what an earlier command wrote is there for a later one: the run a
    `train --resume` continues, the YAML map-args wrote) and not what it writes; exit 0 and its output there.
    30 distinct commands: 200 s on 2 cores with INTEROP_DOC_COMMANDS=all, about 55 s without the two SLOW ones."""
    from click.testing import CliRunner
    from interop.cli.main import main as cli
    failures = []
    for k, (page, command) in enumerate(RUN):
        if not EVERY and command.startswith(SLOW):
            continue
        argv = shlex.split(command)[1:]
        here = tmp_path / f"{k:02d}"
        here.mkdir()
        outputs = {Path(o).name for o in _outputs(argv)}
        for item in named_inputs.iterdir():
            if item.name not in outputs:
                (here / item.name).symlink_to(item)
        source = next((a.lstrip("./") for a in argv[1:] if a.lstrip("./") in CONFIG_OF), None)
        if source is not None:
            (here / "config.json").symlink_to(FIXTURES / CONFIG_OF[source])
        monkeypatch.chdir(here)
        result = CliRunner().invoke(cli, argv)
        if result.exit_code != 0 or not all((here / o).exists() for o in outputs):
            failures.append(f"{page}: `{command}` exit {result.exit_code}: {result.output.strip()[-600:]}")
            continue
        for o in outputs:  # a later command of the docs reads it (train --resume, map-args' YAML)
            if not (named_inputs / o).exists():
                (here / o).rename(named_inputs / o)
    assert not failures, "\n".join(failures)


def test_only_the_lora_commands_wait():
    """The commands not run are exactly the LoRA ones (a new command of any other kind runs)."""
    waiting = [(page, cmd) for page, cmd in ALL if (page, cmd) not in RUN and cmd not in [c for _, c in RUN]]
    assert all(page in ("docs/adapters.md", "docs/training.md") and ("lora" in cmd or "--adapter" in cmd or
                                                                     "./base" in cmd) for page, cmd in waiting)
    assert len(RUN) >= 30
