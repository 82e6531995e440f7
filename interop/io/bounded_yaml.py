"""`yaml.safe_load` with aliases bounded: a "billion laughs" document is one error, not a hang.

YAML aliases (`*a`) make one node appear many times.  PyYAML shares the object, so loading is
cheap, but whoever walks, prints or copies the result (a config reader, an error message) sees
every repetition: nine levels of nine aliases is 387 million strings from 400 bytes.  The composed
node graph is measured first, each node once (memoised), and a document whose expansion is more
than its text could spell out without aliases (`max(MIN_BUDGET, 2 x its length)` values and
characters) is refused before anything is constructed.
"""
from __future__ import annotations

import yaml

MIN_BUDGET = 1_000_000  # values + characters: far above any config (a few KB)


class AliasBomb(yaml.YAMLError):
    """The document expands through its aliases to more than its budget."""


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _expanded_size(root, budget: int) -> int:
    """Values and characters `root` stands for with every alias written out, stopping past `budget`.

    Iterative (a deep document must not exhaust the stack here) and memoised by node; a node that
    contains itself (`&a [*a]`) counts once."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    active: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            total = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            total += sum(sizes.get(id(c), 1) for c in _children(node))
            if total > budget:
                raise AliasBomb(f"the document expands through its aliases to more than {budget:,} values and "
                                "characters (a 'billion laughs' document?)")
            sizes[key] = total
            active.discard(key)
            continue
        if key in sizes or key in active:
            continue
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes and id(c) not in active)
    return sizes[id(root)]


def safe_load(text: str):
    """What `yaml.safe_load(text)` returns; `AliasBomb` (a yaml.YAMLError) for an exploding document."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, max(MIN_BUDGET, 2 * len(text)))
        return loader.construct_document(node)
    finally:
        loader.dispose()
