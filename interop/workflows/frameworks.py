"""Other frameworks running the same run as the reference trainer: HF transformers and MindSpore.

Each takes the same checkpoint (converted to its own format with `interop.convert`),
the same batches (`TokenData`, whole global batch at once) and the same update rule
(`optim.py`: AdamW, schedule, clipping), in a single process, and returns its
per-step losses.  Each is the framework's own model code: transformers'
`AutoModelForCausalLM`, and `mindspore_model.py` in mindspore ops with
gradients from mindspore's autodiff (`value_and_grad`).  The MindSpore weights stay
in their native fused layout; the update applied to them is `optim.py`'s AdamW (on
torch copies of the same numbers), since AdamW is element-wise and the point is one
update rule everywhere.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from interop.errors import InteropError

from ..trainer.config import TrainConfig
from ..trainer.data import TokenData
from ..trainer.optim import clip_grad_norm, lr_at, make_adamw, set_lr


def _convert(ckpt, dst, fmt: str, **options):
    from interop.convert import convert_here  # one process, also inside a framework's ranks
    convert_here(ckpt, dst, dst_format=fmt, src_format="interop", options=options or None)


def hf_losses(ckpt, cfg: TrainConfig) -> list[float]:
    """Train HF transformers' model of the checkpoint for `cfg.steps` updates; with `cfg.adapter` (a LoRA run),
    that common-format adapter converted to HF PEFT's files, loaded by `PeftModel.from_pretrained` on the frozen
    model and trained alone."""
    try:
        import transformers
    except ImportError:
        raise InteropError("framework hf is not available: transformers is not installed") from None
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="interop-parity-hf-") as tmp:
        _convert(ckpt, Path(tmp) / "hf", "hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf", dtype=torch.float32,
                                                                  attn_implementation="eager")
        if cfg.adapter:
            model = _peft_model(model, cfg.adapter, Path(tmp) / "peft")
    model.eval()  # no dropout, like the reference trainer; gradients are unaffected by eval()
    vocab = model.config.vocab_size
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # all, or the adapter's
    optimizer = make_adamw(named, cfg.optim())
    params = [p for _, p in named]
    data = TokenData(vocab, cfg.seq_length, cfg.seed, cfg.data)
    losses = []
    for step in range(1, cfg.steps + 1):
        tokens, targets = data.batch((step - 1) * cfg.global_batch_size, cfg.global_batch_size)
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        clip_grad_norm([(p.grad, True) for p in params], cfg.clip_grad)
        set_lr(optimizer, lr_at(cfg.optim(), step, cfg.steps))
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _peft_model(model, adapter, dst: Path):
    """`model` with the common-format `adapter` on it, through PEFT's own files and loader (trainable)."""
    try:
        import peft
    except ImportError:
        raise InteropError("framework hf cannot train a LoRA adapter: peft is not installed") from None
    _convert(adapter, dst, "peft")
    return peft.PeftModel.from_pretrained(model, dst, is_trainable=True)


def mindspore_losses(ckpt, cfg: TrainConfig) -> list[float]:
    """Train the MindSpore model (`mindspore_model.py`) with mindspore autodiff and the same AdamW."""
    try:
        import mindspore as ms
        from . import mindspore_model
    except ImportError as exc:
        raise InteropError(f"framework mindspore is not available: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="interop-parity-ms-") as tmp:
        _convert(ckpt, Path(tmp) / "ms", "mindspore")
        model = mindspore_model.load(Path(tmp) / "ms")
    names = sorted(model.weights)
    params = [ms.Parameter(model.weights[n], name=n.replace(".", "_")) for n in names]

    def loss_fn(tokens, targets, *weights):
        model.weights = dict(zip(names, weights))
        logits = mindspore_model.logits(model, tokens)
        logp = ms.ops.log_softmax(logits.reshape(-1, logits.shape[-1]), -1)
        return -ms.ops.gather_elements(logp, 1, targets.reshape(-1, 1)).mean()

    grad_fn = ms.value_and_grad(loss_fn, grad_position=tuple(range(2, 2 + len(names))))
    # The update in torch on the same numbers (torch.optim.AdamW), as for every framework.
    tensors = [torch.nn.Parameter(torch.from_numpy(p.asnumpy().copy())) for p in params]
    optimizer = make_adamw([(n, t) for n, t in zip(names, tensors)], cfg.optim())
    data = TokenData(model.spec.vocab, cfg.seq_length, cfg.seed, cfg.data)
    losses = []
    for step in range(1, cfg.steps + 1):
        tokens, targets = data.batch((step - 1) * cfg.global_batch_size, cfg.global_batch_size)
        weights = [ms.Tensor(t.detach().numpy()) for t in tensors]
        loss, grads = grad_fn(tokens.numpy().astype(np.int32), ms.Tensor(targets.numpy().astype(np.int32)), *weights)
        for t, g in zip(tensors, grads):
            t.grad = torch.from_numpy(np.ascontiguousarray(g.asnumpy()))
        clip_grad_norm([(t.grad, True) for t in tensors], cfg.clip_grad)
        set_lr(optimizer, lr_at(cfg.optim(), step, cfg.steps))
        optimizer.step()
        losses.append(float(loss.asnumpy()))
    return losses
