"""The tokenizer file a checkpoint names (Megatron's `--tokenizer-model`, kept as `TrainingState.tokenizer_model`).

The name comes from the checkpoint, so it is the checkpoint's author who picks it: `/proc/self/environ` or
`~/.ssh/id_rsa` would be copied into the output.  It is carried only when it lies inside the checkpoint
(symlinks resolved, `interop.io.paths.within`); otherwise the summary says so and `--tokenizer` names it.
"""
from __future__ import annotations

import os
from pathlib import Path

from .io.paths import within
from .state import TrainingState

TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model")


def with_named_tokenizer(carried: dict, state: dict | None, src, given: bool) -> tuple[dict, str | None]:
    """(carried, note): `carried` plus the checkpoint's named tokenizer when it lies inside `src` and neither
    `--tokenizer` (`given`) nor a carried tokenizer file replaces it; the note says what was or was not taken."""
    named = TrainingState.of(state).tokenizer_model
    files = carried.get("files") or {}
    if named is None or given or set(files) & set(TOKENIZER_NAMES):
        return carried, None
    root = Path(src) if Path(src).is_dir() else Path(src).parent
    path = Path(named) if os.path.isabs(named) else root / named
    if not (within(root, path) and path.is_file()):
        return carried, (f"tokenizer not copied: the checkpoint names {named!r}, which is not a file inside the "
                         "checkpoint (give --tokenizer to name it)")
    name = "tokenizer.json" if path.name.endswith(".json") else "tokenizer.model"
    return ({**carried, "files": {**files, name: path}},
            f"tokenizer: {named}, the checkpoint's --tokenizer-model (--tokenizer overrides)")
