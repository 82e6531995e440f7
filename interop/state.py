"""Training state: neutral fields every format may read, and per-format extensions only their owners read.

A conversion carries it as `Source.state`, the JSON dict the formats state it in: the common store's
manifest and MindSpore's sidecar keep that dict as it is (key order included), so their bytes do not
depend on this module.  `TrainingState.of(state)` is its typed form, for code that reads it.

- Neutral fields (the interop trainer's state, `trainer/train.py` `_state`): `iteration`,
  `consumed_samples`, `data`, `scheduler` (in iterations), `optimizer` (type, step, betas, ...),
  `trainer`, `rng`, and `tokenizer_model` (the tokenizer file a source names, e.g. Megatron's
  `--tokenizer-model`).
- Extensions: what only a format's own writer can use, under the format's key.  `EXTENSIONS` names
  who may read each: Megatron-LM's loop state (its args, `OptimizerParamScheduler` state, optimizer
  param groups) is read by the Megatron format and by MindSpore's MindSpeed dialect, which runs the
  same loop and stores the same state; MindSpeed's epoch counter by MindSpore only.
  `tests/core/test_architecture.py` holds every other module to the neutral fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# extension key -> the formats (converter packages) that read it
EXTENSIONS = {"megatron": ("megatron", "mindspore"), "mindspeed": ("mindspore",)}


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class TrainingState:
    """The typed form of a `Source.state` dict (fields absent or of the wrong type read as None / {})."""

    iteration: int | None = None
    consumed_samples: int | None = None
    data: dict = field(default_factory=dict)
    scheduler: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)
    tokenizer_model: str | None = None
    extensions: dict = field(default_factory=dict)  # {extension key: its dict}, for the owning formats only

    @classmethod
    def of(cls, state: dict | None) -> "TrainingState":
        state = state or {}
        named = state.get("tokenizer_model")
        return cls(_int(state.get("iteration")), _int(state.get("consumed_samples")), _dict(state.get("data")),
                   _dict(state.get("scheduler")), _dict(state.get("optimizer")), _dict(state.get("trainer")),
                   _dict(state.get("rng")), named if isinstance(named, str) and named else None,
                   {k: _dict(state.get(k)) for k in EXTENSIONS if isinstance(state.get(k), dict)})
