"""Every command in README.md and docs/ (their ```bash blocks): each `interop ...` line parses with the CLI as it
is (no removed command, option or choice), and the README's first conversion runs, exactly as written, on a tiny
Llama with a tokenizer (issue 27 item 14); every file the docs link to exists (issue 23)."""
import json
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
