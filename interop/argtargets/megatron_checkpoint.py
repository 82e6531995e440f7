"""The `args` a Megatron checkpoint stores (common.pt or mp_rank_00*/model_optim_rng.pt): read only."""
from __future__ import annotations

from pathlib import Path

from ..argtable import Unmapped, typed
from ..errors import InteropError
from ..io.megatron_save import TRACKER, iteration_name, read_tracker
from ..mappings import megatron_args as M
from . import ArgsTarget


def _checkpoint_file(path: Path) -> Path:
    """The file that holds `args`: common.pt (torch_dist) or model_optim_rng.pt (legacy)."""
    if path.is_file():
        return path
    if (path / TRACKER).exists():
        path = path / iteration_name(read_tracker(path))
    if (path / "common.pt").exists():
        return path / "common.pt"
    for name in ("mp_rank_00", "mp_rank_00_000"):
        if (path / name / "model_optim_rng.pt").exists():
            return path / name / "model_optim_rng.pt"
    raise InteropError(f"{path}: not a Megatron checkpoint (no latest_checkpointed_iteration.txt, common.pt "
                       "or mp_rank_00*/model_optim_rng.pt)")


class MegatronCheckpoint(ArgsTarget):
    name = "megatron-checkpoint"
    syntax = "checkpoint"  # a directory, or a torch.save zip / pickle
    writable = False

    def load(self, path: Path, env: dict | None) -> tuple[dict, list[Unmapped], list[str]]:
        from ..io.safe_pickle import safe_torch_load, to_plain  # torch: only a checkpoint needs it
        file = _checkpoint_file(path)
        state = safe_torch_load(file)  # the allow-listing unpickler, never plain torch.load
        args = state.get("args") if isinstance(state, dict) else None
        if args is None:
            raise InteropError(f"{file}: the checkpoint stores no args; give an args file or config.json instead")
        stored = dict(vars(args)) if not isinstance(args, dict) else dict(args)
        explicit, ignored = {}, []
        for key, value in stored.items():
            dest = M.CHECKPOINT_ALIASES.get(key, key)
            arg = M.ARGS.get(dest)
            if arg is None:
                ignored.append(key)
                continue
            value = typed(dest, to_plain(value), str(file))  # a string where an int belongs: one line, not a crash
            if value != arg.default:
                explicit[dest] = value
        entries = [Unmapped("(checkpoint args)", sorted(ignored), f"{len(ignored)} stored args interop does not model",
                            lost=False)] if ignored else []
        return explicit, entries, []


TARGET = MegatronCheckpoint()
