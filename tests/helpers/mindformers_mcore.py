"""Loading a checkpoint into one of MindFormers' mcore-style models strictly, as its own training would."""
from __future__ import annotations

import torch

STATISTICS = ("expert_load", "fi_accu")  # the MoE router's training counters: not weights


def strict_load(model, path) -> dict:
    """Every parameter loaded but the router's counters, nothing left over; the model's parameters by saved name."""
    import mindspore as ms
    not_loaded, unused = ms.load_param_into_net(model, ms.load_checkpoint(str(path)), strict_load=True)
    assert unused == [], unused
    assert all(n.endswith(STATISTICS) for n in not_loaded), not_loaded
    return {p.name: torch.from_numpy(p.asnumpy().copy()) for _, p in model.parameters_and_names()}
