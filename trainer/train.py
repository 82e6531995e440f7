"""The training loop every rank runs, and `prepare`, which checks a run before any rank starts.

One update (`step`, 1-based):
  1. this data-parallel replica's share of the global batch, cut into micro-batches;
  2. the pipeline schedule runs forward and backward over them (gradients accumulate);
  3. gradients are averaged over data-parallel replicas, and the tied embedding's two
     copies (first and last stage) are summed;
  4. the global gradient norm is clipped, the learning rate set, AdamW steps;
  5. rank 0 logs the mean loss; every `save_interval` updates (and at the end) the
     whole training state is saved in the common format.
"""
from __future__ import annotations

import base64
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from interop.adapter import AdapterSpec
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.params import TensorKey, param_index, param_table
from interop.spec import ModelSpec

from .checkpoint import (has_moments, load_adapter, load_optimizer, load_weights, newest_checkpoint, open_checkpoint,
                         remove_partial_saves, save_checkpoint)
from .config import TrainConfig
from .data import TokenData
from .grid import Grid, build_grid
from .init import init_checkpoint, read_spec
from .lora import attach, check_trainable, init_adapter, lora_targets, settle_shared_a
from .model import Stage, check_model_layout
from .moe import set_aux_loss_scale, update_expert_bias
from .optim import clip_grad_norm, lr_at, make_adamw, set_lr
from .pipeline import train_step


@dataclass
class Plan:
    """A checked run: the config with dp and batch sizes resolved, where to start, and from which step."""
    cfg: TrainConfig
    spec: ModelSpec
    layout: ParallelLayout
    start: str  # checkpoint directory to load
    start_step: int  # 0, or the step of the checkpoint resumed from
    consumed: int  # samples consumed before start_step
    resumed: bool
    fresh_dir: str | None = None  # temporary checkpoint made from --init-spec (deleted after the run)
    adapter: AdapterSpec | None = None  # a LoRA adapter trains on the frozen base `start`
    adapter_start: str | None = None  # the common-format adapter it starts from (fresh, given, or resumed)
    made_save: bool = False  # --save did not exist before this run (a run that fails before saving removes it)

    @property
    def world(self) -> int:
        return self.cfg.dp * self.cfg.tp * self.cfg.pp

    @property
    def micro_batches(self) -> int:
        return self.cfg.global_batch_size // (self.cfg.micro_batch_size * self.cfg.dp)


def prepare(cfg: TrainConfig, world: int | None = None) -> Plan:
    """Check everything a user can get wrong, in the launching process, with one-line errors.

    `world` is the number of processes when someone else launched them (torchrun);
    None when `interop train` launches dp * tp * pp ranks itself.
    """
    fresh = []
    try:
        return _prepare(cfg, world, fresh)
    except BaseException:
        for path in fresh:
            shutil.rmtree(path, ignore_errors=True)
        raise


def _prepare(cfg: TrainConfig, world: int | None, fresh: list) -> Plan:
    cfg = TrainConfig(**cfg.to_dict())
    for name in ("tp", "pp", "ep", "steps", "micro_batch_size", "seq_length", "log_interval"):
        if getattr(cfg, name) < (0 if name == "steps" else 1):
            raise InteropError(f"--{name.replace('_', '-')} must be positive (got {getattr(cfg, name)})")
    ParallelLayout.check_flags(cfg.tp, cfg.pp, 1, cfg.first_stage_layers, cfg.last_stage_layers)
    if world is not None:
        dp = cfg.dp if cfg.dp is not None else world // (cfg.tp * cfg.pp)
        if dp < 1 or dp * cfg.tp * cfg.pp != world:
            raise InteropError(f"world size {world} is not dp*tp*pp = {cfg.dp or '?'}*{cfg.tp}*{cfg.pp}")
        cfg.dp = dp
    cfg.dp = cfg.dp or cfg.ep  # launched by us: as many replicas as the experts need, else 1
    if cfg.dp < 1:
        raise InteropError(f"--dp must be positive (got {cfg.dp})")
    if cfg.dp % cfg.ep:  # Megatron carves the expert-parallel ranks out of the data-parallel ones
        raise InteropError(f"--ep {cfg.ep} must divide dp ({cfg.dp}): expert parallelism splits data-parallel replicas")
    per_step = cfg.micro_batch_size * cfg.dp
    cfg.global_batch_size = cfg.global_batch_size or per_step
    if cfg.global_batch_size % per_step:
        raise InteropError(f"global batch {cfg.global_batch_size} is not a multiple of "
                           f"micro batch {cfg.micro_batch_size} x dp {cfg.dp}")
    cfg.optim()  # validates the schedule

    start_step, consumed, resumed = 0, 0, False
    adapter_start, adapter_reader = None, None  # a resumed LoRA run: its adapter, and that checkpoint's reader
    if not cfg.resume and cfg.save and newest_checkpoint(cfg.save) is not None:
        raise InteropError(f"{cfg.save} already holds checkpoints: add --resume to continue, or choose another --save")
    if cfg.resume:
        found = None
        for where in (cfg.save, cfg.load):
            if where and (found := newest_checkpoint(where)):
                break
        if found is None:
            places = " or ".join(str(p) for p in (cfg.save, cfg.load) if p) or "(give --save or --load)"
            raise InteropError(f"--resume: no complete checkpoint in {places}")
        reader = open_checkpoint(found)
        state = reader.source.state
        if not isinstance(state.get("iteration"), int):
            raise InteropError(f"{found}: no training state to resume from (not saved by the trainer)")
        if not isinstance(state.get("consumed_samples"), int):  # e.g. converted from a checkpoint that had none
            raise InteropError(f"{found}: the training state lacks consumed_samples (the data position), "
                               "so the run cannot continue where it stopped")
        start_step, consumed, resumed, start = int(state["iteration"]), int(state["consumed_samples"]), True, found
        _note_changes(state, cfg, found)
        if cfg.save:
            remove_partial_saves(cfg.save)
        if start_step and not has_moments(reader):
            raise InteropError(f"{found}: incomplete checkpoint, no optimizer moments to resume with")
        if reader.source.adapter is not None:  # a LoRA run's checkpoint is its adapter: the base is --load
            adapter_start, adapter_reader = found, reader
            if not cfg.load or Path(cfg.load).resolve() == Path(found).resolve():
                raise InteropError(f"{found}: a LoRA adapter; resuming it needs its base model too: --load BASE")
            reader = open_checkpoint(cfg.load)
            start = cfg.load
    elif cfg.load:
        reader = open_checkpoint(cfg.load)
        start = cfg.load
    elif cfg.init_spec:
        spec = read_spec(cfg.init_spec)
        fresh.append(tempfile.mkdtemp(prefix="interop-init-"))
        start = init_checkpoint(spec, Path(fresh[0]) / "init", seed=cfg.seed)
        reader = open_checkpoint(start)
    else:
        raise InteropError("nothing to train: give --load CKPT, --init-spec SPEC.yaml or --resume with --save DIR")
    spec = cfg.trained_spec(reader.spec)
    if cfg.mtp_loss_scaling_factor is not None and not spec.mtp_layers:
        print(f"note: --mtp-loss-scaling-factor {cfg.mtp_loss_scaling_factor:g} is unused: {start} has no MTP modules",
              file=sys.stderr, flush=True)
    if reader.source.adapter is not None:
        raise InteropError(f"{start}: a LoRA adapter, not a model: give its base with --load and the adapter with "
                           "--adapter")
    reader.close()
    check_config_model(cfg, spec, start)

    layout = ParallelLayout.build(spec.num_layers, cfg.tp, cfg.pp, first_stage_layers=cfg.first_stage_layers,
                                  last_stage_layers=cfg.last_stage_layers, ep=cfg.ep)
    check_model_layout(spec, layout)
    adapter, adapter_start = _adapter(cfg, spec, layout, adapter_start, adapter_reader, fresh)
    if spec.mtp_layers and cfg.seq_length <= spec.mtp_layers:
        raise InteropError(f"--seq-length {cfg.seq_length}: the model's {spec.mtp_layers} MTP module(s) predict up to "
                           f"{spec.mtp_layers + 1} tokens ahead and need a longer sequence")
    if spec.position == "learned" and cfg.seq_length > spec.max_positions:
        raise InteropError(f"--seq-length {cfg.seq_length} exceeds the model's {spec.max_positions} positions")
    if cfg.data:
        TokenData(spec.vocab, cfg.seq_length, cfg.seed, cfg.data)  # opens and checks the file
    made_save = bool(cfg.save) and not Path(cfg.save).exists()
    if cfg.save:
        try:
            Path(cfg.save).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InteropError(f"{cfg.save}: cannot create the save directory ({exc.strerror})") from None
    return Plan(cfg, spec, layout, str(start), start_step, consumed, resumed, fresh[0] if fresh else None, adapter,
                None if adapter_start is None else str(adapter_start), made_save)


def lora_flags(cfg: TrainConfig, spec: ModelSpec) -> AdapterSpec | None:
    """The adapter --lora-rank / --lora-alpha / --lora-targets / --lora-dropout describe (None: not given); rank,
    alpha and targets are all required, never defaulted."""
    given = {"--lora-rank": cfg.lora_rank, "--lora-alpha": cfg.lora_alpha, "--lora-targets": cfg.lora_targets}
    if all(v is None for v in given.values()):
        return None
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise InteropError(f"a LoRA adapter needs {', '.join(missing)} too (rank, alpha and targets are never "
                           "defaulted)")
    return AdapterSpec(cfg.lora_rank, cfg.lora_alpha, lora_targets(cfg.lora_targets, spec), cfg.lora_dropout,
                       shared_a=bool(cfg.lora_shared_a))


def _adapter(cfg: TrainConfig, spec: ModelSpec, layout: ParallelLayout, resumed_from, resumed_reader, fresh):
    """(adapter, the common-format adapter it starts from) of a LoRA run, or (None, None): resumed, given with
    --adapter, or fresh from the --lora-* flags (drawn from --seed into the run's scratch directory)."""
    flags = lora_flags(cfg, spec)
    if resumed_reader is not None or cfg.adapter:
        if resumed_reader is None:
            resumed_reader = open_checkpoint(cfg.adapter, "adapter")
            if resumed_reader.source.adapter is None:
                raise InteropError(f"--adapter {cfg.adapter}: a model checkpoint, not a LoRA adapter")
        where, reader = resumed_from or cfg.adapter, resumed_reader
        adapter = reader.source.adapter
        shapes = {n: e["shape"] for n, e in reader.manifest["tensors"].items() if not TensorKey.parse(n).is_optim}
        try:
            adapter.check_tensors(spec, shapes, f"{where}: ")  # the adapter is for this base: one line if not
            adapter = settle_shared_a(adapter, spec, reader.read, cfg.lora_shared_a, where)  # a fact of the adapter
        finally:
            reader.close()
        if flags is not None and (flags.rank, flags.alpha, flags.targets) != (adapter.rank, adapter.alpha,
                                                                                adapter.targets):
            raise InteropError(f"--lora-* describe another adapter than {where} (rank {adapter.rank}, alpha "
                               f"{adapter.alpha:g}, {', '.join(adapter.targets)}): drop them, or start a new adapter")
        check_trainable(spec, adapter, layout)
        return adapter, where
    if flags is None:
        return None, None
    check_trainable(spec, flags, layout)
    if not fresh:
        fresh.append(tempfile.mkdtemp(prefix="interop-init-"))
    return flags, init_adapter(spec, flags, Path(fresh[0]) / "adapter", seed=cfg.seed)


def check_config_model(cfg: TrainConfig, spec: ModelSpec, start) -> None:
    """The model comes from the checkpoint; a --config describing another model is refused, not ignored
    (training a 7B config's batch shape on a tiny checkpoint, or the reverse, is never what was meant)."""
    differ = [f"{field} {value} vs {getattr(spec, field)}" for field, value in (cfg.config_model or {}).items()
              if getattr(spec, field) != value and not (field == "vocab" and value == spec.padded_vocab)]
    if differ:
        source = f"--load {cfg.load}" if cfg.load else f"the checkpoint {start}"
        raise InteropError(f"--config {cfg.config_file} describes another model than {source}: {', '.join(differ)} "
                           f"(the model comes from the checkpoint: use a config for this model, or flags)")


def describe_plan(plan: Plan) -> list[str]:
    """The run in a few lines, printed before the first step: what trains, where, on what, saved where."""
    cfg, spec = plan.cfg, plan.spec
    params = 0
    for p in param_table(spec):
        n = 1
        for d in p.shape:
            n *= d
        params += n
    layout = f"tp={cfg.tp} pp={cfg.pp} dp={cfg.dp}" + (f" ep={cfg.ep}" if cfg.ep > 1 else "")
    lines = [f"model: {spec.arch}, {spec.num_layers} layers, hidden {spec.hidden}, {spec.heads} heads, vocab {spec.vocab}: "
             f"{params / 1e6:.2f}M parameters ({'bf16 autocast' if cfg.bf16 else 'fp32'})"
             + (f"; {spec.num_experts} experts, top-{spec.moe_topk}" if spec.is_moe else "")
             + (f"; {spec.mtp_layers} MTP module(s) trained, loss weight {spec.mtp_loss_weight:g}"
                if spec.mtp_layers else ""),
             f"layout: {plan.layout.describe()} dp={cfg.dp}, {plan.world} process(es)"]
    if plan.adapter is not None:
        lora = plan.adapter
        trained = sum(math.prod(p.shape) for p in lora.params(spec))
        fresh = plan.fresh_dir is not None and str(plan.adapter_start).startswith(plan.fresh_dir)
        origin = f"fresh (seed {cfg.seed})" if fresh else plan.adapter_start
        shared = "; one A per fused module (q, k, v; gate, up)" if lora.shared_a and lora.fused_a(spec) else ""
        lines.append(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)}{shared}: {trained:,} "
                     f"trained parameters, the base frozen; adapter {origin}")
    if plan.resumed:
        trainer = {}
        try:
            trainer = open_checkpoint(plan.start).source.state.get("trainer", {})
        except InteropError:
            pass
        was = f"tp={trainer.get('tp')} pp={trainer.get('pp')} dp={trainer.get('dp')}" if trainer else "an unknown layout"
        was += f" ep={trainer['ep']}" if trainer.get("ep", 1) > 1 else ""
        lines.append(f"start: resumed from step {plan.start_step} at {was} ({plan.start}), continuing at {layout}")
    elif plan.fresh_dir and cfg.init_spec:
        lines.append(f"start: fresh random weights for {cfg.init_spec} (seed {cfg.seed})")
    else:
        lines.append(f"start: weights of {plan.start}")
    data = cfg.data or f"synthetic stream (seed {cfg.seed})"
    lines.append(f"data: {data}; {cfg.global_batch_size} sequences of {cfg.seq_length} tokens per step "
                 f"({plan.micro_batches} micro-batch(es) of {cfg.micro_batch_size} x dp {cfg.dp})")
    last = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    lines.append(f"steps: {plan.start_step + 1}..{last} of {cfg.steps}" + (f" (stopping at {cfg.stop_at})"
                                                                          if cfg.stop_at is not None else ""))
    if cfg.save:
        every = f"every {cfg.save_interval} steps and " if cfg.save_interval else ""
        lines.append(f"checkpoints: {cfg.save}/step_NNNNNN, {every}at the end; metrics in {cfg.save}/metrics.jsonl")
    else:
        lines.append("checkpoints: none (no --save)")
    return lines


def _note_changes(state: dict, cfg: TrainConfig, where) -> None:
    """Resuming with another schedule or update rule is allowed, but never silent: the curve will bend."""
    now = _state(Plan(cfg, None, None, "", 0, 0, True), 0, 0)
    changed = [f"{part}.{k} {old!r} -> {now[part][k]!r}" for part in ("scheduler", "optimizer")
               for k, old in state.get(part, {}).items() if k != "step" and k in now[part] and now[part][k] != old]
    if changed:
        print(f"note: resuming {where} with a different {', '.join(changed)}", file=sys.stderr, flush=True)


def _device(local_rank: int, local_world: int) -> torch.device:
    """One GPU per rank when this machine has enough of them (NCCL), else every rank on CPU (gloo).

    INTEROP_DEVICE=cpu forces the CPU.  The choice depends only on the machine, so all ranks agree.
    """
    if os.environ.get("INTEROP_DEVICE") != "cpu" and torch.cuda.is_available() \
            and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def run(plan: Plan, rank: int = 0, world: int = 1, local_rank: int | None = None) -> list[dict]:
    """Train on this rank; returns the per-step metrics (rank 0's view; loss is the global mean)."""
    cfg = plan.cfg
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = _device(rank if local_rank is None else local_rank, local_world)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        grid = build_grid(cfg.tp, cfg.pp, cfg.dp, cfg.ep) if world > 1 else Grid(1, 1, 1, 0)
        return _train(plan, grid, device)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(plan: Plan, grid: Grid, device: torch.device) -> list[dict]:
    cfg, spec, layout = plan.cfg, plan.spec, plan.layout
    torch.manual_seed(cfg.seed)
    stage = Stage(spec, layout, grid)
    reader = open_checkpoint(plan.start)
    load_weights(stage, reader, grid)
    if plan.adapter is not None:  # LoRA: the base frozen, the adapter (and its optimizer state) from its own checkpoint
        names = attach(stage, plan.adapter)
        reader.close()
        reader = open_checkpoint(plan.adapter_start, "adapter")
        load_adapter(stage, reader, grid, names)
    stage.to(device)
    named = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]  # what trains: all, or the adapter
    optimizer = make_adamw(named, cfg.optim())
    if plan.resumed and plan.start_step:
        load_optimizer(optimizer, named, reader, grid, plan.start_step)
        rng = reader.source.state.get("rng", {}).get("torch")
        if rng:
            torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))
    reader.close()
    data = TokenData(spec.vocab, cfg.seq_length, cfg.seed, cfg.data)
    index = param_index(spec) if plan.adapter is None else plan.adapter.index(spec)
    # each gradient counted once in the norm: replicated tensors on tp rank 0, dense ones on ep rank 0
    counted = [stage.owned(n) and (index[n].axis is not None or grid.tp_rank == 0)
               and (index[n].expert is not None or grid.ep_rank == 0) for n, _ in named]
    experts = [index[n].expert is not None for n, _ in named]
    # the word embedding lives on two stages: the last one's copy is the output head or the MTP modules' input
    tied = (spec.tied_embeddings or spec.mtp_layers > 0) and grid.embed_group is not None
    tied_copy = [p for n, p in named if n == "embed.word.weight"] if tied else []
    hidden_shape = (cfg.micro_batch_size, cfg.seq_length, spec.hidden)
    metrics_path = Path(cfg.save) / "metrics.jsonl" if cfg.save and grid.rank == 0 else None
    if metrics_path:
        _trim_metrics(metrics_path, plan.start_step)

    history, consumed = [], plan.consumed
    per_replica = cfg.global_batch_size // cfg.dp
    last = cfg.steps if cfg.stop_at is None else min(cfg.steps, cfg.stop_at)
    for step in range(plan.start_step + 1, last + 1):
        t0 = time.perf_counter()
        micro = _micro_batches(data, consumed + grid.dp_rank * per_replica, plan.micro_batches,
                               cfg.micro_batch_size, device)
        optimizer.zero_grad(set_to_none=False)
        set_aux_loss_scale(stage, 1.0 / plan.micro_batches)  # the aux losses' gradients scaled as the LM loss's
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = train_step(stage, grid, micro, hidden_shape, device)
        _sync_gradients(named, grid, tied_copy, experts)
        norm = clip_grad_norm([(p.grad, c) for (_, p), c in zip(named, counted)], cfg.clip_grad,
                              (grid.tp_group, grid.pp_group, grid.ep_group), device)
        lr = lr_at(cfg.optim(), step, cfg.steps)
        set_lr(optimizer, lr)
        optimizer.step()
        update_expert_bias(stage, cfg.router_bias_update_rate, grid.dp_group)
        consumed += cfg.global_batch_size
        loss_value = _global_loss(loss, grid, device)
        ms = (time.perf_counter() - t0) * 1000
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm, "time_ms": round(ms, 3),
                  "consumed_samples": consumed}
        if spec.mtp_layers:  # logged apart, as Megatron-LM's "mtp_1 loss": the objective adds their weighted mean
            record["mtp_loss"] = _global_mtp_loss(stage, grid, device)
        history.append(record)
        if grid.rank == 0:
            if not cfg.quiet and (step % cfg.log_interval == 0 or step == last):
                epoch = consumed // data.count if data.tokens is not None else 0
                mtp = "".join(f", MTP_{k + 1}_loss: {v:.6f}" for k, v in enumerate(record.get("mtp_loss", [])))
                print(f"Epoch: {epoch}, Step: {step}, Loss: {loss_value:.6f}, Learning_rate: {lr:.6e}, "
                      f"Grad_norm: {norm:.6f}, Time: {ms:.2f} ms{mtp}", flush=True)
            if metrics_path:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
        if cfg.save and ((cfg.save_interval and step % cfg.save_interval == 0) or step == last):
            saved = save_checkpoint(cfg.save, step, stage, optimizer, grid, layout, _state(plan, step, consumed),
                                    plan.adapter)
            if grid.rank == 0 and not cfg.quiet:
                print(f"saved step {step}: {saved}", flush=True)
    if cfg.save and plan.start_step >= last and not plan.resumed:
        save_checkpoint(cfg.save, plan.start_step, stage, optimizer, grid, layout, _state(plan, 0, consumed),
                        plan.adapter)
    return history


def _micro_batches(data: TokenData, first: int, count: int, size: int, device) -> list:
    """This replica's share of the step's batch: `count` micro-batches of `size` samples from sample `first`."""
    out = []
    for m in range(count):
        tokens, targets = data.batch(first + m * size, size)
        out.append((tokens.to(device), targets.to(device)))
    return out


def _sync_gradients(named, grid: Grid, tied_copy, experts) -> None:
    """Average gradients over data-parallel replicas; sum the tied embedding's first- and last-stage copies.

    An expert's gradient already sums the tokens of its ep group (the all-to-all's backward), so it is
    summed over the replicas of the same expert (edp group) and divided by dp, as Megatron does."""
    for (_, p), expert in zip(named, experts):
        group = grid.edp_group if expert else grid.dp_group
        if group is not None:
            dist.all_reduce(p.grad, group=group)
        if grid.dp > 1:
            p.grad.div_(grid.dp)
    for p in tied_copy:
        dist.all_reduce(p.grad, group=grid.embed_group)


def _global_loss(loss, grid: Grid, device) -> float:
    """The step's mean loss: each data-parallel replica's last stage has one; average them everywhere."""
    value = torch.zeros((), dtype=torch.float64, device=device)
    if loss is not None and grid.tp_rank == 0:
        value += loss.double()
    if dist.is_initialized() and grid.world > 1:
        dist.all_reduce(value)
    return float(value) / grid.dp


def _global_mtp_loss(stage, grid: Grid, device) -> list[float]:
    """Each MTP module's loss this step: the mean over the micro-batches of the last stages, averaged over
    data-parallel replicas (Megatron-LM's MTPLossLoggingHelper); the stage's log is emptied."""
    value = torch.zeros(stage.spec.mtp_layers, dtype=torch.float64, device=device)
    if stage.mtp_log and grid.tp_rank == 0:
        value += torch.stack(stage.mtp_log).double().mean(0)
    stage.mtp_log.clear()
    if dist.is_initialized() and grid.world > 1:
        dist.all_reduce(value)
    return [float(v) / grid.dp for v in value]


def _state(plan: Plan, step: int, consumed: int) -> dict:
    cfg = plan.cfg
    rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return {
        "iteration": step,
        "consumed_samples": consumed,
        "scheduler": {"lr": cfg.lr, "min_lr": cfg.min_lr, "warmup": cfg.warmup, "decay_steps": cfg.decay_steps,
                      "decay_style": cfg.decay_style, "total_steps": cfg.steps},
        "optimizer": {"type": "adamw", "step": step, "betas": [cfg.beta1, cfg.beta2], "eps": cfg.eps,
                      "weight_decay": cfg.weight_decay, "clip_grad": cfg.clip_grad},
        "rng": {"seed": cfg.seed, "torch": rng},
        "data": {"source": cfg.data or "synthetic", "seq_length": cfg.seq_length, "consumed_samples": consumed,
                 "global_batch_size": cfg.global_batch_size},
        "trainer": {"tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "micro_batch_size": cfg.micro_batch_size,
                    **({"ep": cfg.ep} if cfg.ep > 1 else {})},
    }


def _trim_metrics(path: Path, start_step: int) -> None:
    """On resume, drop logged steps after the checkpoint (a killed run may have logged past it)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
    path.write_text("".join(line + "\n" for line in keep))


def cleanup(plan: Plan) -> None:
    if plan.fresh_dir:
        shutil.rmtree(plan.fresh_dir, ignore_errors=True)


def discard_failed_save(plan: Plan) -> None:
    """A run that failed (bad --data ids, a signal) before its first checkpoint leaves no --save folder it
    created: nothing of it is usable, and the next run would find a folder it did not ask for."""
    if plan.made_save and newest_checkpoint(plan.cfg.save) is None:
        shutil.rmtree(plan.cfg.save, ignore_errors=True)
