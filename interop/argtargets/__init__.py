"""The configuration formats `interop map-args` reads and writes, by name: registered like the checkpoint formats.

Each target registers itself as an entry point in the `interop.mapargs_targets` group (pyproject.toml:
`name = "module"`); the module's `TARGET` is an `ArgsTarget` that declares its rows (a table target) and
says how it renders, parses and recognises a document.  The map-args engine (`interop.mapargs`) asks
the target, never compares its name: adding a target is one module and one entry point line.

The call order, for `interop map-args SOURCE --to TARGET`:

  1. `detect(path)`: the file is parsed by its syntax (JSON, Python, YAML; else a Megatron args file or
     launch script) and the targets of that syntax are asked `recognises(doc)`, lowest `precedence` first
     (the most specific document shape first; a Megatron checkpoint is told by its files, not a syntax).
  2. `source.load(path, env)`: the file in Megatron's terms (dest -> value), the entries it could not say
     and warnings.
  3. `target.write(explicit)`: the text, the document, {dest: why it cannot be written} and warnings.
  4. `target.read(text, where)`: the written text read back into Megatron's terms, as a user would.
  5. `target.held(before)` / `target.holds(dest, before, after)`: which values the target has a field for
     and which differences are none (the same run); every other difference is a loss in the report.
"""
from __future__ import annotations

import ast
import functools
import importlib
import json
import re
from pathlib import Path

import yaml

from ..errors import InteropError
from ..formats import registered
from ..io import bounded_yaml
from ..io.small_files import read_small_text, require_small_file
from ..argtable import MISSING, Unmapped, get_path, read_table, typed, write_table
from ..mappings import megatron_args as M

GROUP = "interop.mapargs_targets"
MAX_TEXT = 1 << 20  # config files are a few KB (the largest real launch script ~30 KB); parsing is linear but slow in Python
SYNTAXES = ("checkpoint", "json", "python", "yaml", "args")


class ArgsTarget:
    """One configuration format in Megatron's terms.  Defaults are those of a read-only format that holds
    nothing; a subclass overrides what its format does (each method's docstring says when it is called)."""

    name = ""
    syntax = "args"  # how detect parses a file before asking `recognises`: one of SYNTAXES
    precedence = 50  # among the targets of one syntax, the lower is asked first
    writable = False  # True: `--to` offers it (`write` is implemented); False: read as a source only
    positions_from_seq_length = False  # its model sizes the position table by seq_length (MindSpore's)
    markers: tuple = ()  # Python syntax: words without which detect does not parse the file as Python
    unheld_group: str | None = None  # a model config: the given values it has no field for, said as one count
    describes_model = True  # False: its documents hold no model (an adapter's settings): no model sizes required

    def recognises(self, doc) -> bool:
        """Step 1: whether `doc` (the file parsed by `syntax`) is this format's document."""
        return False

    def load(self, path: Path, env: dict | None) -> tuple[dict, list[Unmapped], list[str]]:
        """Step 2: (Megatron values, entries, warnings) from a file of this format."""
        return self.read(read_text(path), str(path))

    def write(self, explicit: dict) -> tuple[str, dict, dict, list[str]]:
        """Step 3: (text, document, {dest or flag: why unmappable}, warnings) for the given values."""
        raise InteropError(f"interop reads {self.name} files but does not write them: choose another --to")

    def read(self, text: str, where: str) -> tuple[dict, list[Unmapped], list[str]]:
        """Step 4 (and step 2 of a text format): Megatron values from this format's text."""
        raise InteropError(f"cannot read {self.name!r}")

    def held(self, before: dict) -> set:
        """Step 5: the Megatron dests the target has a field for (`before`: the completed source values)."""
        return set()

    def holds(self, dest: str, before: dict, after: dict) -> bool:
        """Step 5: True where `dest` reads back differently yet the target runs the same (no loss)."""
        return False

    def note(self, dest: str, value) -> str | None:
        """Step 5: what to tell the user about a given value the target holds, but writes another way."""
        return None

    def unheld_why(self, dest: str) -> str | None:
        """Step 5: why a given value the target has no field for is lost, where more can be said than that."""
        return None


class TableTarget(ArgsTarget):
    """A document written and read through rows (`mappings/*.ROWS`, see `interop.argtable`)."""

    writable = True
    rows: list = []
    nullable = None  # the paths whose loader accepts null (None: any path)
    same_values: dict = {}  # dest -> Megatron values the target runs the same way
    same_meaning: dict = {}  # dest -> rule(before, after): held, though the read-back says it another way
    notes: dict = {}  # (dest, given value) -> a note: held, written another way (the user is told)
    unheld: dict = {}  # dest -> why the target has no field for it (beyond "no field")
    required: tuple = ()  # (path, Megatron dest): values the target's loader needs
    micro_batch_path: str | None = None  # where the micro-batch count goes (said when it cannot be derived)

    def write(self, explicit: dict) -> tuple[str, dict, dict, list[str]]:
        full = M.complete(explicit)
        doc, why = write_table(full, self.rows, self.nullable)
        return self.render(doc, explicit), doc, why, self.warnings(full, doc)

    def render(self, doc: dict, explicit: dict) -> str:
        raise NotImplementedError

    def parse(self, text: str, where: str) -> dict:
        raise NotImplementedError

    def read(self, text: str, where: str) -> tuple[dict, list[Unmapped], list[str]]:
        doc = self.document(text, where)
        try:
            values, entries = read_table(doc, self.rows, self.name)
        except InteropError as exc:
            raise InteropError(f"{where}: {exc}") from None
        values = {dest: typed(dest, value, where) for dest, value in values.items()}
        values, warnings = self.complete(values, doc)
        for dest, value in self.launch(text).items():
            values.setdefault(dest, value)  # the document's own rows win over the comment beside it
        return M.normalize(values), entries, warnings

    def complete(self, values: dict, doc: dict) -> tuple[dict, list[str]]:
        """The values the document implies beyond its rows (a release's fixed model shape), and warnings."""
        return values, []

    def launch(self, text: str) -> dict:
        """Values of the launch the text records beside its document (the world size)."""
        return {}

    def document(self, text: str, where: str) -> dict:
        try:
            doc = self.parse(text, where)
        except (yaml.YAMLError, json.JSONDecodeError, SyntaxError, ValueError) as exc:
            raise InteropError(f"{where}: not a readable {self.name} file ({str(exc).splitlines()[0][:200]})") \
                from None
        except RecursionError:
            raise InteropError(f"{where}: nested too deeply to be a {self.name} file") from None
        if not isinstance(doc, dict):
            raise InteropError(f"{where}: expected a mapping at the top of the {self.name} file")
        return doc

    def held(self, before: dict) -> set:
        return {s for row in self.rows for s in row.source}

    def holds(self, dest: str, before: dict, after: dict) -> bool:
        same = self.same_values.get(dest)
        if same is not None and {before.get(dest), after.get(dest)} <= same:
            return True
        return dest in self.same_meaning and self.same_meaning[dest](before, after)

    def note(self, dest: str, value) -> str | None:
        return self.notes.get((dest, value)) if isinstance(value, (str, int, float, bool)) else None

    def unheld_why(self, dest: str) -> str | None:
        return self.unheld.get(dest)

    def warnings(self, full: dict, doc: dict) -> list[str]:
        warnings = []
        missing = [(path, dest) for path, dest in self.required if get_path(doc, path) is MISSING]
        if missing:
            warnings.append(f"{', '.join(p for p, _ in missing)} not written: the source does not give "
                            f"{', '.join(f for _, f in missing)} (the {self.name} model needs it; give it with "
                            f"{' '.join(f'--set {f}=N' for _, f in missing)})")
        if self.micro_batch_path and full["micro_batch_num"] is None and full["global_batch_size"]:
            warnings.append(f"{self.micro_batch_path}: written as 1: global batch {full['global_batch_size']} / "
                            f"(micro batch {full['micro_batch_size']} * data-parallel size) needs the world size "
                            "(--set world_size=N, or -e for the script's variables)")
        return warnings


# The launcher's rank count, which no YAML section holds: a comment the loaders skip and map-args reads back.
LAUNCH_COMMENT = "# launch: WORLD_SIZE={} (the launcher's rank count; no {} key holds it: launch the job on {} ranks)\n"
LAUNCH_LINE = re.compile(r"^# launch: WORLD_SIZE=(\d+)\b", re.M)
LAUNCH_KEYS = {"world_size", "data_parallel_size"}  # a document with a row for either says the launch itself


class YamlTarget(TableTarget):
    """A YAML document (MindSpeed-Core-MS, MindFormers): `yaml.safe_dump` in row order."""

    syntax = "yaml"
    header = ""  # a first comment line naming the release the keys are

    def render(self, doc: dict, explicit: dict) -> str:
        text = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)
        launch = explicit.get("world_size") if not LAUNCH_KEYS & self.held({}) else None  # else a row says it
        return self.header + (LAUNCH_COMMENT.format(launch, self.name, launch) if launch else "") + text

    def parse(self, text: str, where: str) -> dict:
        return bounded_yaml.safe_load(text)

    def launch(self, text: str) -> dict:
        found = LAUNCH_LINE.search(text)
        return {"world_size": int(found.group(1))} if found else {}


class JsonTarget(TableTarget):
    syntax = "json"

    def render(self, doc: dict, explicit: dict) -> str:
        return json.dumps(doc, indent=2) + "\n"

    def parse(self, text: str, where: str) -> dict:
        return json.loads(text)


# ---------------------------------------------------------------- the registry

def _registered() -> dict[str, str]:
    return registered(GROUP, "map-args targets")


@functools.lru_cache(maxsize=None)
def get(name: str) -> ArgsTarget:
    """The target registered as `name`."""
    modules = _registered()
    if name not in modules:
        raise InteropError(f"unknown map-args format {name!r} (known: {', '.join(modules)})")
    target = importlib.import_module(modules[name]).TARGET
    if target.name != name or target.syntax not in SYNTAXES:
        raise InteropError(f"map-args target {modules[name]} registers as {name!r} but declares "
                           f"{target.name!r} ({target.syntax!r})")
    return target


def names() -> tuple[str, ...]:
    """Every registered format, read only ones included."""
    return tuple(_registered())


def writable() -> tuple[str, ...]:
    """The formats `--to` offers."""
    return tuple(name for name in names() if get(name).writable)


def _of_syntax(syntax: str) -> list[ArgsTarget]:
    return sorted((get(n) for n in names() if get(n).syntax == syntax), key=lambda t: (t.precedence, t.name))


# ---------------------------------------------------------------- detection by content

def read_text(path: Path, what: str = "file") -> str:
    return read_small_text(path, what, MAX_TEXT)  # a regular file of bounded size: FIFOs, /dev/zero refused


def _looks_like_yaml(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return bool(re.match(r"^[A-Za-z_][\w.-]*:(\s|$)", line))
    return False


def _first(syntax: str, doc) -> str | None:
    return next((t.name for t in _of_syntax(syntax) if t.recognises(doc)), None)


def _python(text: str) -> str | None:
    candidates = [t for t in _of_syntax("python") if any(m in text for m in t.markers)]
    if not candidates:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return next((t.name for t in candidates if t.recognises(tree)), None)


def detect(path: Path) -> str:
    """The source format, from the file's content (never its name); a file that fits none says --from."""
    if path.is_dir():
        return _of_syntax("checkpoint")[0].name
    require_small_file(path, "args file", limit=1 << 62)  # a regular file (FIFOs, devices refused); any size yet
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise InteropError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return _of_syntax("checkpoint")[0].name  # a torch.save zip or pickle: model_optim_rng.pt / common.pt
    text = read_text(path, "args file")
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InteropError(f"{path}: cannot read JSON ({str(exc)[:200]})") from None
        except RecursionError:
            raise InteropError(f"{path}: JSON nested too deeply to be a config") from None
        found = _first("json", doc) if isinstance(doc, dict) else None
        if found:
            return found
        raise InteropError(f"{path}: a JSON file that is neither a Hugging Face config.json (no model_type) nor a "
                           "DeepSpeed config: use --from")
    found = _python(text)
    if found:
        return found
    if _looks_like_yaml(text):
        try:
            doc = bounded_yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InteropError(f"{path}: cannot read YAML ({str(exc).splitlines()[0][:200]})") from None
        except RecursionError:
            raise InteropError(f"{path}: YAML nested too deeply to be a config") from None
        if isinstance(doc, dict):
            found = _first("yaml", doc)
            if found is None:
                raise InteropError(f"{path}: a YAML mapping with none of the sections interop reads "
                                   f"({', '.join(map(str, list(doc)[:5]))}): use --from")
            return found
    return _first("args", text)


def section(doc: dict, key: str) -> dict:
    """doc[key] when it is a mapping, else {} (recognising a document never fails on its shape)."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def sections(doc: dict) -> set:
    return {k for k in doc if isinstance(k, str)}
