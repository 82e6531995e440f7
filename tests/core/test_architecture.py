"""The import rules of ARCHITECTURE.md, checked on the source tree (issue 14).

Every `import` / `from ... import` anywhere in a module counts, a function-level (lazy) one
too, and so does `importlib.import_module("...")` / `__import__("...")` with a literal name.
The layers, lowest first:

  core       interop/*.py, interop/io/, interop/transforms/  (the hub: spec, params, store, engine, registry)
  mappings   mappings/                                       (declarative tables)
  converters converters/<format>                             (one reader + writer per format)
  trainer    trainer/                                        (reads and writes the common format only)
  workflows  interop/workflows/                              (verify, demo, parity: converters + trainer)
  cli        cli/, interop/__main__.py                       (click over the library)
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # import name -> folder
MAP_ARGS_ENGINE = ("interop.mapargs", "interop.argsfile")
OPENS_OTHER_FORMATS = ("interop.convert", "interop.formats", "interop.describe")


def _module_name(path: Path) -> str:
    """The import name of a source file, through pyproject's package-dir (converters/ -> interop.converters)."""
    rel = path.relative_to(ROOT)
    best = max((folder for folder in PACKAGE_DIRS.values() if rel.is_relative_to(folder)), key=len)
    package = next(name for name, folder in PACKAGE_DIRS.items() if folder == best)
    parts = list(rel.relative_to(best).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _sources() -> dict[str, Path]:
    out = {}
    for folder in sorted(set(PACKAGE_DIRS.values())):
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[_module_name(path)] = path
    return out


SOURCES = _sources()


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, absolute, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            for alias in node.names:  # `from . import x` imports the module `pkg.x` when there is one
                if f"{target}.{alias.name}" in SOURCES:
                    found.add(f"{target}.{alias.name}")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            found.add(node.args[0].value)
    return {m for m in found if m == "interop" or m.startswith("interop.")}


def layer(name: str) -> str:
    if name.startswith("interop.cli") or name == "interop.__main__":
        return "cli"
    for prefix in ("workflows", "trainer", "converters", "mappings"):
        if name == f"interop.{prefix}" or name.startswith(f"interop.{prefix}."):
            return prefix
    return "core"


def converter_of(name: str) -> str:
    """interop.converters.megatron.args -> interop.converters.megatron (the converter it belongs to)."""
    return ".".join(name.split(".")[:3])


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(name: str, imported: set[str]) -> list[str]:
    """Why each of `name`'s imports breaks the rules (empty when none does)."""
    mine, out = layer(name), []
    for target in sorted(imported):
        theirs = layer(target)
        if mine == "core" and theirs in ("converters", "trainer", "workflows", "cli"):
            out.append(f"core imports {theirs}: {target}")
        elif mine == "mappings" and theirs != "mappings" and (theirs != "core" or _under(target, MAP_ARGS_ENGINE)):
            out.append(f"a mapping table imports {target}")
        elif mine == "converters":
            if theirs in ("trainer", "workflows", "cli"):
                out.append(f"a converter imports {theirs}: {target}")
            elif theirs == "converters" and target != "interop.converters" and converter_of(target) != converter_of(name):
                out.append(f"a converter imports another converter: {target}")
            elif _under(target, MAP_ARGS_ENGINE):
                out.append(f"a converter imports the map-args engine: {target}")
        elif mine == "trainer":
            if theirs in ("converters", "workflows", "cli") or _under(target, OPENS_OTHER_FORMATS):
                out.append(f"the trainer imports {target} (it reads only the common format)")
        elif mine == "workflows" and theirs == "cli":
            out.append(f"a workflow imports the CLI: {target}")
    return out


def test_the_source_tree_keeps_the_import_rules():
    broken = {name: why for name, path in SOURCES.items() if (why := violations(name, _imports(name, path)))}
    assert not broken, "\n".join(f"{name}: {'; '.join(why)}" for name, why in broken.items())


def test_the_import_rules_catch_each_kind_of_violation():
    """The checker itself: each rule fires on a made-up import, lazy or not, relative or by name."""
    assert violations("interop.convert", {"interop.converters.hf"}) == ["core imports converters: interop.converters.hf"]
    assert violations("interop.io.paths", {"interop.trainer.model"})
    assert violations("interop.describe", {"interop.workflows.verify"})
    assert violations("interop.converters.megatron.args", {"interop.mapargs"})
    assert violations("interop.converters.mindspore.reader", {"interop.converters.megatron.checkpoint"})
    assert not violations("interop.converters.megatron.torch_format", {"interop.converters.megatron.args"})
    assert violations("interop.trainer.parity", {"interop.convert"})
    assert violations("interop.trainer.frameworks", {"interop.formats"})
    assert violations("interop.mappings.hf_args", {"interop.converters.hf"})
    assert not violations("interop.workflows.verify", {"interop.convert", "interop.trainer.model", "interop.formats"})
    assert violations("interop.workflows.demo", {"interop.cli.main"})
    assert not violations("interop.cli.main", {"interop.workflows.demo", "interop.converters.hf"})


def test_lazy_relative_and_by_name_imports_are_seen(tmp_path):
    source = tmp_path / "probe.py"  # read as if it were the core module interop.probe
    source.write_text("def f():\n    from .converters import hf\n    from . import mapargs\n"
                      "    import importlib\n    importlib.import_module('interop.trainer.model')\n")
    found = _imports("interop.probe", source)
    assert {"interop.converters", "interop.mapargs", "interop.trainer.model"} <= found, found
    assert violations("interop.probe", found)


def test_every_package_is_in_the_distribution():
    """A folder of modules missing from pyproject's package list is missing from a non-editable wheel."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    packages = {name for name, path in SOURCES.items() if path.name == "__init__.py"}
    assert packages <= listed, sorted(packages - listed)
    for name in listed:
        assert PACKAGE_DIRS.get(name), f"{name} has no package-dir entry"


def test_every_converter_registers_itself_and_only_converters_do():
    """The core registry knows the formats only through the `interop.formats` entry points."""
    from interop import formats
    registered = PYPROJECT["project"]["entry-points"]["interop.formats"]
    assert all(layer(module) == "converters" for module in registered.values()), registered
    converters = {converter_of(n) for n in SOURCES if layer(n) == "converters" and n != "interop.converters"}
    assert converters == set(registered.values())
    assert formats.names() == tuple(sorted(registered))  # the installed metadata is pyproject's
    for name in registered:
        module = formats.converter(name)
        assert callable(module.detect) and formats.reader_of(name) is module.Reader
        if hasattr(module, "Writer"):
            assert formats.writer_of(name) is module.Writer


def test_a_read_only_format_as_target_is_one_error_line(tmp_path):
    """deepspeed has a Reader only: naming it as --to is refused in one line, before anything is read."""
    from click.testing import CliRunner
    from interop.cli.main import main
    from interop.errors import InteropError
    from interop.formats import writer_of
    with pytest.raises(InteropError, match="reads deepspeed checkpoints but does not write them"):
        writer_of("deepspeed")
    (tmp_path / "src").mkdir()
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--from", "interop",
                                       "--to", "deepspeed"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        "error: interop reads deepspeed checkpoints but does not write them: choose another --to"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("word", ["Source", "Entry", "Row"])
def test_class_names_are_not_reused(word):
    """Two classes of one name in different modules read as one concept; each name explains itself."""
    defined = [name for name, path in SOURCES.items()
               if re.search(rf"^class {word}\b", path.read_text(), re.M)]
    assert len(defined) <= 1, defined


# ---------------------------------------------------------------- the format contract (issue 23)

ENGINE = ("interop.engine", "interop.workers", "interop.convert")


def _probes(path: Path) -> list[str]:
    """`hasattr(...)`, `getattr(...)` and any use of `inspect` in a module: how code asks an object what it has."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            found.append(f"{path.name}:{node.lineno} {node.func.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if "inspect" in names:
                found.append(f"{path.name}:{node.lineno} import inspect")
    return found


def test_the_engine_calls_the_contract_and_never_probes():
    """The engine learns what a reader or writer can do from `interop.contract`'s methods (every optional
    capability has a no-op default), never by asking the object what it has."""
    for name in ENGINE:
        assert _probes(SOURCES[name]) == [], name


def test_the_probe_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import inspect\ndef f(reader):\n    return hasattr(reader, 'x') or getattr(reader, 'y', 0)\n")
    assert len(_probes(probe)) == 3


def test_the_engine_has_no_import_cycle():
    """convert drives the engine and the workers; the workers run the engine; the engine imports neither."""
    assert not {"interop.convert", "interop.workers"} & _imports("interop.engine", SOURCES["interop.engine"])
    assert "interop.convert" not in _imports("interop.workers", SOURCES["interop.workers"])


def _format_classes():
    """Every class named Reader or Writer that a converter module defines: each format's own, and the classes
    a format with several on-disk layouts opens (Megatron: torch, torch_dist; DeepSpeed: its layouts)."""
    import importlib
    found = []
    for name in SOURCES:
        if layer(name) == "converters":
            module = importlib.import_module(name)
            found += [cls for attr in ("Reader", "Writer") if (cls := vars(module).get(attr)) is not None
                      and isinstance(cls, type) and cls.__module__ == name]
    return found


def test_every_format_subclasses_the_contract():
    """Every format's Reader and Writer (and the classes they open) subclass `BaseReader` / `BaseWriter`,
    and each declares exactly the format keywords its constructor takes (`options`: how the engine routes
    `--dialect`, `--tokenizer`, ... without reading signatures)."""
    import inspect

    from interop import formats
    from interop.contract import BaseReader, BaseWriter
    engine_keywords = {"self", "path", "root", "spec", "layout", "metas", "only", "verify", "verify_share",
                       "adapter", "base"}  # adapter=: a writer that holds_adapter; base=: an adapter reader's base spec
    classes = _format_classes()
    assert {formats.converter(name).Reader for name in formats.names()} <= set(classes)
    for cls in classes:
        assert issubclass(cls, BaseReader if cls.__name__ == "Reader" else BaseWriter), cls
        keywords = set(inspect.signature(cls).parameters) - engine_keywords  # __init__'s, or a picking __new__'s
        assert set(cls.options) == keywords, (cls, cls.options, keywords)


def _extension_reads(path: Path) -> list[tuple[int, str]]:
    """(line, extension) for each `<...state...>["ext"]` / `<...state...>.get("ext")` of a format's state
    extension (`interop.state.EXTENSIONS`) in a module."""
    from interop.state import EXTENSIONS
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base, key = node.value, node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "setdefault")
              and node.args and isinstance(node.args[0], ast.Constant)):
            base, key = node.func.value, node.args[0].value
        else:
            continue
        if key in EXTENSIONS and "state" in ast.unparse(base):
            found.append((node.lineno, key))
    return found


def test_only_its_formats_read_a_state_extension():
    """A format's training-state extension (`state["megatron"]`: Megatron-LM's args, scheduler and optimizer
    groups) is read only by the formats `interop.state.EXTENSIONS` names; everything else reads the neutral
    fields (`TrainingState`)."""
    from interop.state import EXTENSIONS
    for name, path in SOURCES.items():
        owner = converter_of(name) if layer(name) == "converters" else None
        for line, key in _extension_reads(path):
            allowed = {f"interop.converters.{fmt}" for fmt in EXTENSIONS[key]}
            assert owner in allowed, f"{name}:{line} reads the {key!r} state extension"


def test_the_extension_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(state, source):\n    return state.get('megatron'), source.state['mindspeed'], x['megatron']\n")
    assert [key for _, key in _extension_reads(probe)] == ["megatron", "mindspeed"]


def _optim_literals(path: Path) -> list[int]:
    """Lines of code (not docstrings) that spell an optimizer-state name prefix (`"optim."...`) themselves."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(node, clean=False) is not None}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and node.value.startswith("optim.")]


def test_optimizer_state_is_told_by_its_tensor_key():
    """Whether a canonical name is a weight or which optimizer state of one is `params.TensorKey`'s to say;
    code elsewhere does not compare name prefixes (the name tables in mappings may spell them)."""
    for name, path in SOURCES.items():
        if name != "interop.params" and layer(name) != "mappings":
            assert _optim_literals(path) == [], name


def test_the_prefix_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""optim.exp_avg. in a docstring is fine."""\ndef f(n):\n    return n.startswith("optim.")\n')
    assert _optim_literals(probe) == [3]
