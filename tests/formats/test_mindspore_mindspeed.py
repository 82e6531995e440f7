"""MindSpeed-Core-MS checkpoints as its own tools write and load them (r0.1.0; MindSpeed-Core-MS is not on
PyPI, so its behaviour is encoded here from its source, each fact citing the file in Ascend/MindSpeed-Core-MS
at tag r0.1.0; the `.ckpt` bytes are produced by the real `mindspore.save_checkpoint`, as the tool does):

- tools/converter/convert_pt2ckpt.py:
  * run(): output `<ms-path>/rank_{r}/network.ckpt` (`--file-prefix` 'network', `--format` 'ckpt');
    get_ms_dir_format(): r = pp_rank * dp * cp * tp + dp_rank * cp * tp + cp_rank * tp + tp_rank
    (order tp-cp-ep-dp-pp), dp_rank = cp_rank = 0 unless --generate-all-dp-cp copies the file.
  * convert_pt2ms_param_only(): the Megatron model dict (`model`, or `model{v}` per virtual chunk)
    flattened with dots; _convert_param_name() drops `module`, renames components by PARAM_KEY_MAP
    (dense_h_to_4h -> mapping, dense_4h_to_h -> projection, self_attention -> attention,
    query_key_value -> qkv_proj, dense -> out_proj), and makes layer numbers global (+ the stage's offset
    sum(stage_list[:pp_stage]), or with --vpp-size vpp_layer_mapping[pp][vpp][local] where
    get_vpp_layers_map() = np.split(np.arange(L).reshape(vpp, L // vpp), pp, -1)); every value is cast to
    mindspore float32.  Other names (word_embeddings_for_head.weight, norms' weight/bias,
    position_embeddings.weight) pass through unchanged.
  * get_pt2ms_args(): append_dict = step_num (the iteration from the `iter_XXXXXXX` folder), epoch_num 0,
    each optimizer param group's values as `<key>_group_<i>` (`lr` -> `learning_rate`; a list ->
    Parameter of floats; int / float / bool -> Parameter(float(v)); others dropped), the group's `step` as
    `state_step` = Parameter([float(step)]); the scheduler's keys typed by OPT_SCHEDULER_MAP (fp64 ->
    Tensor float64, int64 -> Parameter(int(v)), lr_decay_style / wd_incr_style as indices of
    LR_DECAY_STYLE / WD_INCR_STYLE).
- core/dist_checkpointing/checkpointing.py load_checkpoint(): the newest `*.ckpt` of
  `<load_checkpoint>/rank_{get_rank()}`; pops epoch_num / step_num; load_rng_state; the scheduler's
  load_state_dict; then `mindspore.load_param_into_net(model, param_dict)`.
- training/training.py: a rank without its folder loads `rank_{pp_rank * dp * tp + tp_rank}` (dp with cp).
- training/optimizer_param_scheduler.py load_state_dict(): int(v.item()) of lr_warmup_steps, num_steps,
  lr_decay_style, lr_decay_steps, wd_incr_style, wd_incr_steps; v.item() of max_lr, min_lr, start_wd, end_wd.
- The model's parameter names (legacy/model/*.py): LayerNorm holds `gamma` / `beta` (norm.py), RMSNorm
  `weight`; the learned position embedding is a mindspore nn.Embedding (`embedding_table`) unless
  parallel_position_embedding (default False, core/config.py); layers are named by global number
  (transformer.py: layers_dict[str(i + offset)]); output_layer exists when untied or under pipeline
  parallelism (language_model.py), the tied copy filled from the embedding (module.py).
- tools/converter/convert_ckpt2pt.py (the reverse tool): reads the newest `*.ckpt` of
  `rank_{pp * dp * cp * tp_size + tp}`, `ckpt["step_num"]`, and for each Megatron key of that rank
  (param_map or pt_meta's param_name_list): ms_key = the key without its first component, layers renumbered
  by cal_corr_vpp_layers, then `str.replace` of each param_key_mapping entry; ckpt[ms_key] (and
  `exp_avg.` / `exp_avg_sq.` + ms_key with the optimizer), reshaped to the Megatron numel.
"""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers.hf_models import assert_same_hf
from helpers.hostile import run
from interop.convert import convert
from interop.converters.mindspore.scalars import state_to_scalars
from interop.io.ms_ckpt import CkptFile
from helpers.mindspeed_legacy import ms, PARAM_KEY_MAP, pt2ms_args, megatron_legacy_ranks, run_convert_pt2ckpt, PT_EXTRA




# ---------------------------------------------------------------- a legacy Megatron model, by hand




# ---------------------------------------------------------------- convert_pt2ckpt.py, re-encoded














CASES = [("llama", 2, 2, 1), ("gpt2", 2, 3, 1), ("llama-tied", 1, 2, 3), ("llama", 2, 3, 2)]


# ---------------------------------------------------------------- reading the real tool's output


@pytest.mark.parametrize("kind,tp,pp,vpp", CASES)
def test_reads_convert_pt2ckpt_output_directly(hf_checkpoints, tmp_path, kind, tp, pp, vpp):
    """No interop sidecar: tp, pp and virtual chunks come from the files; scalars become training state."""
    src = hf_checkpoints[kind]
    run_convert_pt2ckpt(megatron_legacy_ranks(src, kind, tp, pp, vpp), tmp_path / "ms", 6, tp, pp, vpp,
                        pt_extra=PT_EXTRA)
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--from", "mindspore", "--to", "hf",
                    "--model-config", src / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(src, tmp_path / "back")
    code, out = run("convert", tmp_path / "ms", tmp_path / "common", "--from", "mindspore", "--to", "interop",
                    "--model-config", src / "config.json", "-q")
    assert code == 0, out
    manifest = json.loads((tmp_path / "common" / "interop.json").read_text())
    state = manifest["state"]
    assert state["iteration"] == 40 and state["mindspeed"] == {"epoch_num": 0}
    assert state["megatron"]["optimizer"]["step"] == 40
    group = state["megatron"]["optimizer"]["param_groups"][0]
    assert group["lr"] == pytest.approx(3e-4) and group["betas"] == pytest.approx([0.9, 0.95])
    assert group["bias_correction"] is True and "params" not in group
    sched = state["megatron"]["opt_param_scheduler"]
    assert sched["lr_decay_style"] == "cosine" and sched["wd_incr_style"] == "constant"
    assert sched["num_steps"] == 320 and sched["max_lr"] == pytest.approx(3e-4)


def test_reads_dp_copies_and_a_state_step_tp1_file(hf_checkpoints, tmp_path):
    """--generate-all-dp-cp copies: rank_{p*dp*tp + d*tp + t}; dp rank 0 is read, the copies noted."""
    src = hf_checkpoints["llama"]
    ranks = megatron_legacy_ranks(src, "llama", 2, 2)
    run_convert_pt2ckpt(ranks, tmp_path / "ms", 6, 2, 2, dp=2, pt_extra=PT_EXTRA)
    for p in range(2):
        for t in range(2):
            (tmp_path / "ms" / f"rank_{p * 4 + 2 + t}").mkdir()
            (tmp_path / "ms" / f"rank_{p * 4 + 2 + t}" / "network.ckpt").write_bytes(
                (tmp_path / "ms" / f"rank_{p * 4 + t}" / "network.ckpt").read_bytes())
    summary = convert(tmp_path / "ms", tmp_path / "back", dst_format="hf",
                      options={"model_config": str(src / "config.json")})
    assert_same_hf(src, tmp_path / "back")
    assert any("4 data-parallel copies were not read" in n for n in summary.notes)


# ---------------------------------------------------------------- what interop writes


@pytest.mark.parametrize("kind,tp,pp,vpp", CASES)
def test_writer_equals_convert_pt2ckpt_plus_the_model_names(hf_checkpoints, tmp_path, kind, tp, pp, vpp):
    """Same folders, names, shapes, dtypes and values as the real tool, plus the model's names: LayerNorm also
    as gamma/beta, the position embedding also as embedding_table, and the tied head on the last stage also
    as language_model.output_layer.weight (besides Megatron's word_embeddings_for_head.weight)."""
    src = hf_checkpoints[kind]
    run_convert_pt2ckpt(megatron_legacy_ranks(src, kind, tp, pp, vpp), tmp_path / "real", 6, tp, pp, vpp)
    convert(src, tmp_path / "ours", dst_format="mindspore", tp=tp, pp=pp, vpp=vpp, options={"dialect": "mindspeed"})
    real_ranks = sorted(p.name for p in (tmp_path / "real").glob("rank_*"))
    assert sorted(p.name for p in (tmp_path / "ours").glob("rank_*")) == real_ranks
    for rank in real_ranks:
        real = ms.load_checkpoint(str(tmp_path / "real" / rank / "network.ckpt"))
        ours = ms.load_checkpoint(str(tmp_path / "ours" / rank / "network.ckpt"))  # mindspore reads our file
        assert set(real) <= set(ours), set(real) - set(ours)
        extra = set(ours) - set(real)
        twins = ("_norm.weight", "_norm.bias", "position_embeddings.weight") if kind == "gpt2" else ()
        heads = {"language_model.output_layer.weight"} if "word_embeddings_for_head.weight" in real else set()
        assert len(extra) == sum(n.endswith(twins) for n in real) + len(heads) if twins else extra == heads, extra
        for name in real:
            if name in ("step_num", "epoch_num"):
                continue
            a, b = real[name].asnumpy(), ours[name].asnumpy()
            assert a.shape == b.shape and a.dtype == b.dtype and (a == b).all(), (rank, name)
        for name in extra:
            twin = name.replace(".gamma", ".weight").replace(".beta", ".bias").replace(".embedding_table", ".weight")
            twin = "word_embeddings_for_head.weight" if name in heads else twin
            assert (ours[name].asnumpy() == real[twin].asnumpy()).all(), name


def test_scalars_equal_get_pt2ms_args(tmp_path):
    """The training state written as the same tags, dtypes, shapes and values as get_pt2ms_args()."""
    state = {"iteration": 40, "megatron": {
        "optimizer": {"step": 40, "param_groups": [{k: v for k, v in PT_EXTRA["optimizer"]["optimizer"]
                                                    ["param_groups"][0].items() if k not in ("step", "params")}]},
        "opt_param_scheduler": PT_EXTRA["opt_param_scheduler"]}}
    ours, notes = state_to_scalars(state)
    ms.save_checkpoint({"w": ms.Parameter(ms.Tensor(np.zeros(1, np.float32)))}, str(tmp_path / "real.ckpt"),
                       append_dict=pt2ms_args(PT_EXTRA, 40))
    with CkptFile(tmp_path / "real.ckpt") as real:
        tags = [t for t in real.keys() if t not in ("w", "params_group_0")]  # the indices: not state
        assert sorted(tags) == sorted(ours)
        for tag in tags:
            assert real.meta(tag) == (ours[tag].dtype, tuple(ours[tag].shape)), tag
            assert torch.equal(real.read(tag), ours[tag]), tag
    assert notes == []


# ---------------------------------------------------------------- MindSpeed training loads it


def mindspeed_model_params(spec_kind, tp, pp, vpp, p, t):
    """{name: local shape} of the parameters MindSpeed-Core-MS r0.1.0's legacy GPT model builds on stage p,
    tp rank t (names per the module docstring; shapes of its Column/RowParallelLinear and
    VocabParallelEmbedding shards)."""
    gpt2 = spec_kind == "gpt2"
    L, h, heads = 6, 64, 8
    kv, ffn, vocab = (8, 128, 250) if gpt2 else (4, 96, 250)
    d = h // heads
    tied = spec_kind in ("gpt2", "llama-tied")
    per = L // (pp * vpp)
    layers = [i for v in range(vpp) for i in range((v * pp + p) * per, (v * pp + p + 1) * per)]
    norm = ("gamma", "beta") if gpt2 else ("weight",)
    out = {}
    if p == 0:
        out["language_model.embedding.word_embeddings.weight"] = (vocab // tp, h)
        if gpt2:
            out["language_model.embedding.position_embeddings.embedding_table"] = (64, h)
    for i in layers:
        pre = f"language_model.encoder.layers.{i}."
        for leaf in norm:
            out[pre + "input_norm." + leaf] = (h,)
            out[pre + "post_attention_norm." + leaf] = (h,)
        out[pre + "attention.qkv_proj.weight"] = ((heads + 2 * kv) * d // tp, h)
        out[pre + "attention.out_proj.weight"] = (h, heads * d // tp)
        out[pre + "mlp.mapping.weight"] = ((ffn if gpt2 else 2 * ffn) // tp, h)
        out[pre + "mlp.projection.weight"] = (h, ffn // tp)
        if gpt2:
            out[pre + "attention.qkv_proj.bias"] = ((heads + 2 * kv) * d // tp,)
            out[pre + "attention.out_proj.bias"] = (h,)
            out[pre + "mlp.mapping.bias"] = (ffn // tp,)
            out[pre + "mlp.projection.bias"] = (h,)
    if p == pp - 1:
        for leaf in norm:
            out["language_model.encoder.final_norm." + leaf] = (h,)
        if not tied or pp > 1:
            out["language_model.output_layer.weight"] = (vocab // tp, h)
    return out


class _Net(ms.nn.Cell):
    """A cell holding parameters with exactly the given names (what load_param_into_net matches on)."""

    def __init__(self, shapes):
        super().__init__(auto_prefix=False)
        self.params = ms.ParameterTuple([ms.Parameter(ms.Tensor(np.zeros(s, np.float32)), name=n)
                                         for n, s in shapes.items()])


@pytest.mark.parametrize("kind,tp,pp,vpp,dp", [("gpt2", 2, 3, 1, 1), ("llama-tied", 1, 2, 3, 1),
                                               ("llama", 2, 2, 1, 2)])
def test_mindspeed_load_checkpoint_takes_every_parameter(hf_checkpoints, tmp_path, kind, tp, pp, vpp, dp):
    """Emulates load_checkpoint() for every rank of a tp x dp x pp run on interop's output: the folder (or
    its dp-0 fallback), the newest .ckpt, the popped scalars, then load_param_into_net leaves no model
    parameter unloaded; the tied head on the last stage equals the embedding."""
    src = hf_checkpoints[kind]
    code, out = run("convert", src, tmp_path / "ms", "--to", "mindspore", "--dialect", "mindspeed", "--tp", tp,
                    "--pp", pp, "--vpp", vpp, "--dp", dp, "-q")
    assert code == 0, out
    hf = load_file(src / "model.safetensors")
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                rank = p * dp * tp + d * tp + t
                folder = tmp_path / "ms" / f"rank_{rank}"
                if not folder.exists():  # training.py's fallback to the dp-0 rank
                    folder = tmp_path / "ms" / f"rank_{p * dp * tp + t}"
                newest = max(folder.glob("*.ckpt"), key=lambda f: f.stat().st_mtime)
                param_dict = ms.load_checkpoint(str(newest))
                resume = {"epoch_num": int(param_dict.pop("epoch_num", 0)),
                          "step_num": int(param_dict.pop("step_num", 0))}
                assert resume == {"epoch_num": 0, "step_num": 0}
                net = _Net(mindspeed_model_params(kind, tp, pp, vpp, p, t))
                not_loaded, _ = ms.load_param_into_net(net, param_dict, strict_load=True)
                assert not_loaded == [], (rank, not_loaded)
                if kind != "llama" and p == pp - 1 and pp > 1:
                    head = param_dict["language_model.output_layer.weight"].asnumpy()
                    embed = hf["transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"]
                    assert (head == embed.numpy()[t * head.shape[0]:(t + 1) * head.shape[0]]).all()
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "hf", "-q")
    assert code == 0, out
    assert_same_hf(src, tmp_path / "back")


# ---------------------------------------------------------------- MindSpeed's reverse tool accepts it


@pytest.mark.parametrize("kind,tp,pp,vpp", [("llama", 2, 2, 1), ("gpt2", 2, 1, 1), ("llama", 1, 2, 3),
                                            ("gpt2", 2, 3, 1), ("llama-tied", 1, 2, 3)])
def test_convert_ckpt2pt_finds_every_key(hf_checkpoints, tmp_path, kind, tp, pp, vpp):
    """Every key convert_ckpt2pt.py reads from interop's output is there with the Megatron tensor's numel
    and a float dtype (it casts with astype(np.float32)), weights and Adam moments alike."""
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "plain", dst_format="interop")
    reader = StoreReader(tmp_path / "plain")
    metas = reader.metas()
    moments = [TensorMeta(p + m.name, torch.float32, m.shape) for p in ("optim.exp_avg.", "optim.exp_avg_sq.")
               for m in metas]
    (tmp_path / "with_optim").mkdir()
    writer = StoreWriter(tmp_path / "with_optim", reader.spec, ParallelLayout.build(6), metas + moments)
    for m in metas + moments:
        writer.write(m.name, reader.read(m.name) if not m.name.startswith("optim.") else torch.rand(m.shape))
    writer.finish({"iteration": 12})
    convert(tmp_path / "with_optim", tmp_path / "ms", dst_format="mindspore", tp=tp, pp=pp, vpp=vpp,
            options={"dialect": "mindspeed"})
    megatron = megatron_legacy_ranks(src, kind, tp, pp, vpp)
    dp_size, cp_size, num_layers = 1, 1, 6
    for p in range(pp):
        for t in range(tp):
            ckpt_dir = tmp_path / "ms" / f"rank_{p * dp_size * cp_size * tp + t}"
            ckpt = ms.load_checkpoint(str(max(ckpt_dir.glob("*ckpt"), key=lambda f: f.stat().st_mtime)))
            assert int(ckpt["step_num"].asnumpy().astype(np.float32)) == 12
            for v in range(vpp):
                vpp_layers = np.split(np.arange(num_layers), vpp, axis=-1)[v]  # cal_corr_vpp_layers
                vpp_ms_layers = np.split(vpp_layers, pp, axis=-1)[p].tolist()
                chunk = megatron[(t, p)]["model" if vpp == 1 else f"model{v}"]
                for key, value in chunk.items():
                    ms_key = key  # (the param-name list's keys start with 'model.': that component is dropped)
                    if "layers" in ms_key:
                        parts = ms_key.split(".")
                        i = parts.index("layers") + 1
                        parts[i] = str(vpp_ms_layers[int(parts[i])])
                        ms_key = ".".join(parts)
                    for old, new in PARAM_KEY_MAP.items():
                        if old in ms_key:
                            ms_key = ms_key.replace(old, new)
                    for prefix in ("", "exp_avg.", "exp_avg_sq."):
                        got = ckpt[prefix + ms_key].asnumpy()
                        assert got.size == value.numel() and got.dtype.kind == "f", (p, t, prefix + ms_key)
                    assert (ckpt[ms_key].asnumpy().reshape(value.shape) == value.numpy()).all(), ms_key


# ---------------------------------------------------------------- complete or refused


def test_a_missing_moment_refuses_instead_of_dropping_all(hf_checkpoints, tmp_path):
    """A rank file missing one exp_avg.* tensor: one error line naming it, not a silent weights-only read."""
    from interop.io.ms_ckpt import load_ckpt, save_ckpt
    src = hf_checkpoints["llama"]
    run_convert_pt2ckpt(megatron_legacy_ranks(src, "llama", 1, 1), tmp_path / "ms", 6, 1, 1)
    path = tmp_path / "ms" / "rank_0" / "network.ckpt"
    tensors = load_ckpt(path)
    for name in [n for n in tensors if n.startswith("language_model.")]:
        tensors["exp_avg." + name] = torch.zeros_like(tensors[name])
        tensors["exp_avg_sq." + name] = torch.zeros_like(tensors[name])
    del tensors["exp_avg.language_model.encoder.layers.3.mlp.mapping.weight"]
    save_ckpt(path, tensors)
    code, out = run("convert", tmp_path / "ms", tmp_path / "out", "--to", "hf", "--model-config",
                    src / "config.json", "-q")
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "exp_avg.language_model.encoder.layers.3.mlp.mapping.weight is missing" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_tied_head_that_differs_is_refused(hf_checkpoints, tmp_path):
    src = hf_checkpoints["llama-tied"]
    ranks = megatron_legacy_ranks(src, "llama-tied", 1, 2)
    head = ranks[(0, 1)]["model"]
    head["word_embeddings_for_head.weight"] = head["word_embeddings_for_head.weight"] + 1
    run_convert_pt2ckpt(ranks, tmp_path / "ms", 6, 1, 2)
    code, out = run("convert", tmp_path / "ms", tmp_path / "out", "--to", "hf", "--model-config",
                    src / "config.json", "-q")
    assert code == 2 and "word_embeddings_for_head.weight differs from the tied embedding" in out, out


def test_reads_files_with_only_the_models_names(hf_checkpoints, tmp_path):
    """MindSpeed's own save_checkpoint writes the model's names only (gamma / beta, embedding_table)."""
    from interop.io.ms_ckpt import load_ckpt, save_ckpt
    src = hf_checkpoints["gpt2"]
    convert(src, tmp_path / "ms", dst_format="mindspore", tp=2, pp=2, options={"dialect": "mindspeed"})
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    for path in (tmp_path / "ms").glob("rank_*/network.ckpt"):
        tensors = load_ckpt(path)
        save_ckpt(path, {k: v for k, v in tensors.items()
                         if not k.endswith(("_norm.weight", "_norm.bias", "position_embeddings.weight"))})
    with CkptFile(tmp_path / "ms" / "rank_0" / "network.ckpt") as f:
        assert "language_model.encoder.layers.0.input_norm.gamma" in f
        assert "language_model.encoder.layers.0.input_norm.weight" not in f
    code, out = run("convert", tmp_path / "ms", tmp_path / "back", "--to", "hf", "--model-config",
                    src / "config.json", "-q")
    assert code == 0, out
    assert_same_hf(src, tmp_path / "back")
