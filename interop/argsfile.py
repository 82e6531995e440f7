"""Read a Megatron launch script or args file the way bash would, as far as flags go.

People keep their Megatron arguments in launch scripts: variables
(`NUM_LAYERS=32`, `TP=${TP:-2}`, `WORLD_SIZE=$(($GPUS*$NODES))`), strings and
bash arrays of flags with backslash continuations, comments, and a
`torchrun ... pretrain_gpt.py $GPT_ARGS ...` line. We evaluate just that subset
(assignments, `$VAR` / `${VAR}` / `${VAR:-default}` / `${ARR[@]}`, `$((...))`,
quoting, word splitting) and never run anything. A variable the file does not
set stays in the text as `${NAME}` and is listed in `unresolved`, so a typed
flag can say exactly which `-e NAME=VALUE` is missing.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InteropError
from .io.small_files import read_small_text

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ASSIGN = re.compile(rf"^({_NAME})(\+?)=(.*)$", re.S)
_SEPARATORS = ("&&", "||", ";", "|", "&", "\n")
# How each launcher spells "processes per node" and "nodes": world size = product.
LAUNCHER_WORLD = {
    "--nproc_per_node": "per_node", "--nproc-per-node": "per_node",  # torchrun / torch.distributed.launch
    "--nnodes": "nodes",
    "--num_gpus": "per_node", "--num_nodes": "nodes",  # deepspeed
    "--worker_num": "world",  # msrun (MindSpore)
}


@dataclass
class LaunchArgs:
    """What a script says: the Megatron tokens, the launcher's words, and what was left unknown."""

    tokens: list[str]
    launcher: list[str] = field(default_factory=list)
    variables: dict = field(default_factory=dict)
    unresolved: list[str] = field(default_factory=list)
    world_size: int | None = None


# ---------------------------------------------------------------- lexing

@dataclass
class _Seg:
    text: str
    quoted: bool  # inside "..." : expansions are not word-split
    literal: bool = False  # inside '...' : no expansion at all


def _read_balanced(text: str, i: int) -> int:
    """Index just past the `)` that closes the `(` at text[i]."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise InteropError("unbalanced '(' in script")


def _lex(text: str):
    """Yield commands: lists of words (lists of _Seg) or ("array", name, words) items."""
    i, n = 0, len(text)
    command: list = []
    word: list[_Seg] = []
    buf: list[str] = []

    def flush_buf(quoted=False, literal=False):
        if buf:
            word.append(_Seg("".join(buf), quoted, literal))
            buf.clear()

    def end_word():
        flush_buf()
        if word:
            command.append(list(word))
            word.clear()

    while i < n:
        c = text[i]
        if c == "\\":
            nxt = text[i + 1] if i + 1 < n else ""
            if nxt != "\n":
                buf.append("\\" + nxt if nxt == "$" else nxt)
            i += 2
        elif c == "'":
            flush_buf()
            j = text.find("'", i + 1)
            if j < 0:
                raise InteropError("unterminated single quote in script")
            word.append(_Seg(text[i + 1:j], True, True))
            if i + 1 == j:
                word.append(_Seg("", True, True))
            i = j + 1
        elif c == '"':
            flush_buf()
            j, chunk = i + 1, []
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    nxt = text[j + 1]
                    if nxt == "\n":
                        j += 2
                        continue
                    chunk.append("\\$" if nxt == "$" else (nxt if nxt in '"\\`' else "\\" + nxt))
                    j += 2
                    continue
                if text.startswith("$(", j):
                    k = _read_balanced(text, j + 1)
                    chunk.append(text[j:k])
                    j = k
                    continue
                chunk.append(text[j])
                j += 1
            if j >= n:
                raise InteropError("unterminated double quote in script")
            word.append(_Seg("".join(chunk), True))
            i = j + 1
        elif c == "$" and text.startswith("$(", i):
            k = _read_balanced(text, i + 1)
            buf.append(text[i:k])
            i = k
        elif c == "$" and text.startswith("${", i):
            k = text.find("}", i)
            k = n - 1 if k < 0 else k
            buf.append(text[i:k + 1])
            i = k + 1
        elif c == "#" and not buf and not word:
            while i < n and text[i] != "\n":
                i += 1
        elif c == "<" and re.match(r"<[^<>\n'\"]*>", text[i:]):
            # `<Specify path>` placeholders in example scripts: keep them as text.
            k = text.index(">", i)
            buf.append(text[i:k + 1])
            i = k + 1
        elif c == "(" and not word and re.fullmatch(rf"{_NAME}\+?=", "".join(buf)):
            name = "".join(buf)
            buf.clear()
            k = _read_balanced(text, i)
            inner = [w for cmd in _lex(text[i + 1:k - 1]) for w in cmd if isinstance(w, list)]
            command.append(("array", name, inner))
            i = k
        elif c in " \t":
            end_word()
            i += 1
        elif any(text.startswith(s, i) for s in _SEPARATORS):
            end_word()
            if command:
                yield command
                command = []
            i += 2 if text.startswith(("&&", "||"), i) else 1
        else:
            buf.append(c)
            i += 1
    end_word()
    if command:
        yield command


# ---------------------------------------------------------------- expansion

_ARITH_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv, ast.Mod: operator.mod}


ARITH_LIMIT = 2 ** 63  # bash arithmetic is 64-bit; bigger is not a size anyone launches with


def _arith(expr: str) -> int:
    """Bash integer arithmetic on + - * / % and parentheses (division truncates), within 64 bits."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            if abs(node.value) >= ARITH_LIMIT:
                raise ValueError(expr)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            value = _ARITH_OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(value) >= ARITH_LIMIT:
                raise ValueError(expr)
            return value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(expr)
    return ev(ast.parse(expr.replace("/", "//").replace("////", "//"), mode="eval"))


MAX_EXPANDED = 16 << 20  # characters all of a script's expansions may produce: 16 x the largest file


class _Shell:
    def __init__(self, env: dict[str, str], overrides: dict[str, str]):
        self.vars: dict[str, object] = dict(env)
        self.overrides = dict(overrides)
        self.vars.update(overrides)
        self.unresolved: list[str] = []
        self.expanded = 0  # characters produced by expansions so far (`A="$A$A"` 40 times is 2**40)

    def _taken(self, name: str, value):
        """`value` of variable `name` as it is expanded, counted against MAX_EXPANDED: a script whose
        variables double (`A="$A$A"`) would otherwise take memory without bound, not a launch."""
        self.expanded += len(value) if isinstance(value, str) else sum(len(v) + 1 for v in value)
        if self.expanded > MAX_EXPANDED:
            raise InteropError(f"its variables expand to more than {MAX_EXPANDED >> 20} MiB of text (${name} "
                               "grows as it is used: a variable doubling itself?); not a launch script")
        return value

    def _missing(self, name: str) -> str:
        if name not in self.unresolved:
            self.unresolved.append(name)
        return "${" + name + "}"

    def _command(self, cmd: str) -> str:
        """`$(...)` would run a program: never; keep the text and say so."""
        text = "$(" + cmd + ")"
        if text not in self.unresolved:
            self.unresolved.append(text)
        return text

    def string(self, segs: list[_Seg]) -> str:
        """Expand without word splitting, as bash does for the value of an assignment."""
        out = []
        for seg in segs:
            out.append(seg.text if seg.literal else "".join(t.replace("\x00", " ") for t, _ in self.expand_text(seg.text)))
        return "".join(out)

    def lookup(self, name: str, index: str | None = None) -> list[str] | str:
        value = self.vars.get(name)
        if value is None:
            return self._missing(name)
        self._taken(name, value)
        if isinstance(value, list):
            if index in ("@", "*"):
                return list(value)
            return value[int(index)] if index and (index.isascii() and index.isdigit()) and int(index) < len(value) else (value[0] if value else "")
        return value

    def expand_text(self, text: str) -> list[tuple[str, bool]]:
        """Pieces of text: (string, came_from_expansion). Expansions may later be word-split."""
        pieces: list[tuple[str, bool]] = []
        pattern = re.compile(
            r"\\\$|\$\(\((?P<arith>.*?)\)\)|\$\((?P<cmd>.*?)\)|\$\{(?P<brace>[^}]*)\}|\$(?P<plain>[A-Za-z_][A-Za-z0-9_]*|[0-9@*#?])",
            re.S)
        pos = 0
        for m in pattern.finditer(text):
            pieces.append((text[pos:m.start()], False))
            pos = m.end()
            if m.group(0) == "\\$":
                pieces.append(("$", False))
            elif m.group("arith") is not None:
                pieces.append((self._arith(m.group("arith")), True))
            elif m.group("cmd") is not None:
                pieces.append((self._command(m.group("cmd")), False))
            elif m.group("brace") is not None:
                pieces.extend(self._brace(m.group("brace")))
            else:
                value = self.lookup(m.group("plain"))
                pieces.append((" ".join(value) if isinstance(value, list) else value, True))
        pieces.append((text[pos:], False))
        return pieces

    def _brace(self, inner: str) -> list[tuple[str, bool]]:
        m = re.fullmatch(rf"({_NAME}|[0-9]+)(?:\[([^\]]+)\])?(?:(:?[-=+])(.*))?", inner, re.S)
        if not m:
            return [(self._missing(inner), False)]
        name, index, op, word = m.groups()
        if op:
            current = self.vars.get(name)
            empty = current is None or (op.startswith(":") and current in ("", []))
            if op.endswith("-") or op.endswith("="):
                if not empty:
                    self._taken(name, current)
                    return [(current if isinstance(current, str) else " ".join(current), True)]
                default = "".join(s for s, _ in self.expand_text(word))
                if op.endswith("="):
                    self.vars[name] = default
                return [(default, True)]
            return [("" if empty else "".join(s for s, _ in self.expand_text(word)), True)]
        value = self.lookup(name, index)
        if isinstance(value, list):
            return [("\x00".join(value), True)]  # array elements stay separate words
        return [(value, True)]

    def _arith(self, expr: str) -> str:
        text = "".join(s for s, _ in self.expand_text(expr))
        text = re.sub(_NAME, lambda m: str(self.vars.get(m.group(0), "${%s}" % m.group(0))), text)
        try:
            return str(_arith(text))
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError, MemoryError):
            return "$((" + expr + "))"

    def words(self, word: list[_Seg]) -> list[str]:
        """Expand one lexed word into the fields bash would produce."""
        fields: list[str] = []
        current: list[str] = []
        has_text = False
        for seg in word:
            if seg.literal:
                current.append(seg.text)
                has_text = True
                continue
            for text, expanded in self.expand_text(seg.text):
                if "\x00" in text:  # "${ARR[@]}": one word per element, quoted or not
                    parts = text.split("\x00")
                    current.append(parts[0])
                    for part in parts[1:]:
                        fields.append("".join(current))
                        current = [part]
                    has_text = True
                elif expanded and not seg.quoted:
                    parts = _split(text)
                    if not parts:
                        continue
                    if text[:1].isspace() and (current or has_text):
                        fields.append("".join(current))
                        current, has_text = [], False
                    current.append(parts[0])
                    for part in parts[1:]:
                        fields.append("".join(current))
                        current = [part]
                    has_text = True
                    if text[-1:].isspace():
                        fields.append("".join(current))
                        current, has_text = [], False
                else:
                    if text:
                        current.append(text)
                    has_text = has_text or bool(text) or seg.quoted
        if has_text:
            fields.append("".join(current))
        return fields

    def assign(self, name: str, value: object, append: bool = False) -> None:
        if name in self.overrides:  # -e NAME=VALUE wins over the file's own assignment
            return
        if append and name in self.vars:
            old = self.vars[name]
            value = (old if isinstance(old, list) else [old]) + value if isinstance(value, list) else str(old) + value
        self.vars[name] = value


# ---------------------------------------------------------------- commands

def _run(text: str, shell: _Shell) -> list[list[str]]:
    """Evaluate assignments in order; return the other commands as expanded word lists."""
    commands = []
    for command in _lex(text):
        words: list[str] = []
        assigning = True
        for item in command:
            if isinstance(item, tuple):  # NAME=( ... ) array
                _, name, elems = item
                values = [w for e in elems for w in shell.words(e)]
                shell.assign(name.rstrip("+="), values, append=name.endswith("+="))
                continue
            first = item[0]
            m = None if first.quoted or first.literal else _ASSIGN.match(first.text)
            if assigning and m:
                value = shell.string([_Seg(m.group(3), False)] + item[1:])
                shell.assign(m.group(1), value, append=bool(m.group(2)))
                continue
            if not words and first.text in ("export", "local", "declare", "readonly") and len(item) == 1:
                continue
            assigning = False
            words.extend(shell.words(item))
        if words:
            commands.append(_drop_redirections(words))
    return commands


def _split(text: str) -> list[str]:
    """Bash word splitting, except that a `<placeholder with spaces>` stays one word."""
    return re.findall(r"(?:<[^<>\n]*>|\S)+", text)


def _drop_redirections(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        m = re.fullmatch(r"[0-9&]?>>?(&?[0-9])?|<", w)
        if m:
            skip = not m.group(1)
            continue
        if re.match(r"[0-9&]?>>?\S", w) or (w.startswith("<") and ">" not in w):
            continue
        out.append(w)
    return out


def _world_size(launcher: list[str], variables: dict) -> int | None:
    found: dict[str, int] = {}
    for i, w in enumerate(launcher):
        flag, _, value = w.partition("=")
        what = LAUNCHER_WORLD.get(flag)
        if not what:
            continue
        if not value and i + 1 < len(launcher):
            value = launcher[i + 1]
        value = value.split(":")[-1]  # elastic "--nnodes 1:4": the upper bound
        if value.isascii() and value.isdigit():
            found[what] = int(value)
    if "world" in found:
        return found["world"]
    if "per_node" in found:
        return found["per_node"] * found.get("nodes", 1)
    env = variables.get("WORLD_SIZE")
    return int(env) if isinstance(env, str) and (env.isascii() and env.isdigit()) else None


def parse_text(text: str, env: dict[str, str] | None = None) -> LaunchArgs:
    """Parse script text; `env` supplies variables and overrides the file's own assignments."""
    shell = _Shell({}, env or {})
    commands = _run(text, shell)
    launches = []
    for words in commands:
        for i, w in enumerate(words):
            if w.endswith(".py"):
                tail = words[i + 1:]
                launches.append((sum(t.startswith("--") for t in tail), words[:i], tail))
                break
    if launches:
        _, launcher, tokens = max(launches, key=lambda x: x[0])
    else:  # a plain args file: every command that starts with a flag
        launcher, tokens = [], [w for words in commands if words[0].startswith("-") for w in words]
    variables = {k: v for k, v in shell.vars.items()}
    return LaunchArgs(tokens, launcher, variables, list(shell.unresolved), _world_size(launcher, variables))


MAX_ARGS_FILE = 1 << 20  # bytes: a launch script is a few KB; a 1 MiB one is read in ~2 s


def parse_file(path: str | Path, env: dict[str, str] | None = None) -> LaunchArgs:
    path = Path(path)
    try:
        text = read_small_text(path, "args file", MAX_ARGS_FILE)  # bounded; FIFOs and devices refused
    except OSError as exc:
        raise InteropError(f"{path}: cannot read args file ({exc.__class__.__name__}: {exc})") from None
    try:
        return parse_text(text, env)
    except InteropError as exc:
        raise InteropError(f"{path}: {exc}") from None
