"""The MLP activations of every family, one place for the dense MLP and the routed experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from interop.spec import QUICK_GELU_ALPHA, ModelSpec


def activate(spec: ModelSpec, gate, up):
    """act(gate) * up for a gated MLP (`gate` None otherwise: act(up)).  quick_geglu is gpt-oss's, in transformers'
    GptOssExperts._apply_gate order: gate clamped above and up both ways at glu_clamp, gate * sigmoid(gate * 1.702),
    times (up + glu_linear_offset)."""
    act = spec.activation
    if act == "swiglu":
        return F.silu(gate) * up
    if act == "geglu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if act == "quick_geglu":
        if spec.glu_clamp is not None:
            gate = gate.clamp(min=None, max=spec.glu_clamp)
            up = up.clamp(min=-spec.glu_clamp, max=spec.glu_clamp)
        return (up + spec.glu_linear_offset) * (gate * torch.sigmoid(gate * QUICK_GELU_ALPHA))
    return F.gelu(up, approximate="tanh" if act == "gelu_tanh" else "none")
