"""Qwen2 (tied and untied), Qwen3, Llama-3.x rope scaling and Mistral through every format, against
transformers' own classes (Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM).

Layouts confirmed in the frameworks' sources: megatron-core SelfAttention builds
`q_layernorm` / `k_layernorm` after `linear_qkv` (transformer/attention.py); its rope scaling is
RotaryEmbedding._apply_scaling with low 1 / high 4 / original 8192 fixed
(models/common/embeddings/rotary_pos_embedding.py); its window mask lets query i see keys
i - left .. i + right (transformer/utils.py get_sliding_window_causal_mask).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import helpers.family_models as F
from interop.convert import convert
from interop.converters.megatron.args import explicit_args
from interop.mappings.megatron_spec import args_from_spec, spec_from_args
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.mappings import megatron_args as M
from interop.mappings.hf_config import hf_config_from_spec, spec_from_hf_config
from interop.spec import ModelSpec, llama3_rope_scaling

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, F.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for kind in F.KINDS + ["llama3-odd", "llama3-short"]:
        model = F.build(kind)
        model.save_pretrained(root / kind)
        with torch.no_grad():
            out[kind] = (root / kind, model(TOKENS).logits)
    return out


def model_notes(summary) -> list[str]:
    """Summary notes about the model (not the side files such as generation_config.json)."""
    return [note for note in summary.notes if not note.startswith("not carried:") and "tokenizer" not in note]


def hf_spec(path) -> ModelSpec:
    return spec_from_hf_config(json.loads((path / "config.json").read_text()))


def test_each_family_is_its_facts(checkpoints):
    """The HF config reads as the facts that make the family, and is written back as the same class."""
    qwen2, qwen2_tied, qwen3, llama3, mistral = (hf_spec(checkpoints[k][0]) for k in F.KINDS)
    assert (qwen2.qkv_bias, qwen2.linear_bias, qwen2.has_mlp_bias, qwen2.tied_embeddings) == (True, False, False, False)
    assert qwen2_tied.tied_embeddings and qwen2_tied.qkv_bias and not qwen2_tied.linear_bias
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.heads * qwen3.head_dim != qwen3.hidden
    assert not (qwen3.qkv_bias or qwen3.linear_bias)
    assert llama3.rope_scaling == llama3_rope_scaling(8.0) and llama3.rope_base == 500000.0
    assert mistral.sliding_window == F.SLIDING_WINDOW and not mistral.qkv_bias
    for spec, model_type in zip((qwen2, qwen2_tied, qwen3, llama3, mistral), ("qwen2", "qwen2", "qwen3", "llama", "mistral")):
        config = hf_config_from_spec(spec)
        assert config["model_type"] == model_type
        assert hf_spec_from(config) == spec


def hf_spec_from(config):
    return spec_from_hf_config(json.loads(json.dumps(config)))


@pytest.mark.parametrize("kind", F.KINDS)
def test_every_format_round_trip_is_bit_exact(checkpoints, tmp_path, kind):
    """HF -> Megatron torch tp2/pp2 -> Megatron torch_dist tp2/pp2 -> MindSpore tp2 -> interop pp2 -> HF:
    the same tensors bit for bit, and transformers' own class gives the same logits exactly."""
    src, logits = checkpoints[kind]
    summary = convert(src, tmp_path / "torch", dst_format="megatron", tp=2, pp=2)
    assert model_notes(summary) == []  # nothing of these families is lost in Megatron's args
    convert(tmp_path / "torch", tmp_path / "dist", dst_format="megatron", tp=2, pp=2, options={"format": "torch_dist"})
    last = tmp_path / "dist"
    if kind != "qwen3":  # MindSpore has no place for q/k norms: see test_qwen3_mindspore_is_refused
        convert(last, tmp_path / "ms", dst_format="mindspore", tp=2, pp=1)
        last = tmp_path / "ms"
    convert(last, tmp_path / "io", dst_format="interop", tp=1, pp=2)
    convert(tmp_path / "io", tmp_path / "back", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == json.loads((src / "config.json").read_text())["architectures"][0]
    assert hf_spec(tmp_path / "back") == hf_spec(src)
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)


def test_megatron_checkpoint_args_say_each_family(checkpoints, tmp_path):
    """The stored args carry --add-qkv-bias without --add-bias-linear, --qk-layernorm,
    --use-rope-scaling / --rope-scaling-factor and --window-size (W - 1, 0)."""
    want = {"qwen2": {"add_qkv_bias": True, "add_bias_linear": False, "qk_layernorm": False},
            "qwen3": {"qk_layernorm": True, "add_qkv_bias": False},
            "llama3": {"use_rope_scaling": True, "rope_scaling_factor": 8.0},
            "mistral": {"window_size": (F.SLIDING_WINDOW - 1, 0), "use_rope_scaling": False}}
    for kind, expected in want.items():
        convert(checkpoints[kind][0], tmp_path / kind, dst_format="megatron", tp=2, pp=1)
        state = torch.load(tmp_path / kind / "release" / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
        args = vars(state["args"])
        assert {k: args[k] for k in expected} == expected, kind
        if kind == "qwen3":
            q_norm = state["model"]["decoder.layers.0.self_attention.q_layernorm.weight"]
            hf = load_file(checkpoints[kind][0] / "model.safetensors")
            assert torch.equal(q_norm, hf["model.layers.0.self_attn.q_norm.weight"])  # whole on every tp rank


@pytest.mark.parametrize("kind", F.KINDS + ["llama3-odd"])
def test_megatron_args_round_trip(checkpoints, kind):
    """ModelSpec -> Megatron args -> ModelSpec keeps every family fact Megatron can say."""
    spec = hf_spec(checkpoints[kind][0])
    args = args_from_spec(spec, ParallelLayout.build(spec.num_layers, 2, 2))
    back = spec_from_args(M.complete(explicit_args(args)), "args")  # as a checkpoint's stored args are read
    if kind == "llama3-odd":  # core's flags fix 1 / 4 / 8192: the whole scaling rides beside them (issue 27 item 11)
        assert args["rope_scaling_factor"] == 16.0 and args["interop_rope_scaling"] == spec.rope_scaling
    assert back == spec


def test_rope_scaling_megatron_cannot_say_is_a_note(checkpoints, tmp_path):
    """Llama-3 scaling other than Megatron's fixed 1 / 4 / 8192: the tensors convert, the summary says what
    the args lost; through interop alone the facts survive exactly."""
    src, logits = checkpoints["llama3-odd"]
    summary = convert(src, tmp_path / "meg", dst_format="megatron", tp=1, pp=1)
    assert any("--use-rope-scaling" in note and "1024" in note for note in summary.notes), summary.notes
    convert(src, tmp_path / "io", dst_format="interop", tp=2, pp=1)
    summary = convert(tmp_path / "io", tmp_path / "back", dst_format="hf")
    assert model_notes(summary) == []
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == \
        json.loads((src / "config.json").read_text())["rope_parameters"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, logits)


def test_qwen3_mindspore_is_refused(checkpoints, tmp_path):
    """Neither MindSpore dialect's table names q/k norms: one error line, nothing written."""
    for dialect in ("mindspeed", "mindformers"):
        with pytest.raises(InteropError, match="no place for layers.0.attn.q_norm.weight"):
            convert(checkpoints["qwen3"][0], tmp_path / dialect, dst_format="mindspore", options={"dialect": dialect})
        assert not (tmp_path / dialect).exists()


def test_legacy_megatron_has_no_qk_norm(checkpoints):
    from interop.converters.megatron.rows import expand_rows
    spec = hf_spec(checkpoints["qwen3"][0])
    with pytest.raises(InteropError, match="legacy names have no place for layers.0.attn.q_norm.weight"):
        expand_rows("legacy", spec, ParallelLayout.build(spec.num_layers))
    assert len(expand_rows("mcore", spec, ParallelLayout.build(spec.num_layers))) > 0


def test_hf_refusals():
    """Configs whose model the spec cannot describe are refused with the reason."""
    base = hf_config_from_spec(hf_spec_from({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
                                             "num_attention_heads": 8, "intermediate_size": 96, "vocab_size": 100}))
    with pytest.raises(InteropError, match="use_sliding_window"):
        hf_spec_from(base | {"use_sliding_window": True, "sliding_window": 16})
    with pytest.raises(InteropError, match="rope type 'yarn'"):
        hf_spec_from(base | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(InteropError, match="llama3 rope scaling lacks low_freq_factor"):
        hf_spec_from(base | {"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}})
    with pytest.raises(InteropError, match="low_freq_factor must be a number"):
        hf_spec_from(base | {"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4,
                                                 "low_freq_factor": "1", "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192}})
    mistral = base | {"model_type": "mistral"}
    with pytest.raises(InteropError, match="sliding_window must be a positive integer"):
        hf_spec_from(mistral | {"sliding_window": "4096"})
    assert hf_spec_from(mistral | {"sliding_window": 7}).sliding_window == 7
    with pytest.raises(InteropError, match="window_size=.*not a .left, right. pair"):
        spec_from_args(M.complete({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 100,
                                   "window_size": 5}), "args")
    spec = hf_spec_from(base)
    with pytest.raises(InteropError, match="HF qwen2 cannot hold a sliding window"):
        hf_config_from_spec(spec.replace(sliding_window=8))
    with pytest.raises(InteropError, match="rope_scaling must have exactly the keys"):
        spec.replace(rope_scaling={"type": "llama3", "factor": 8.0})
    with pytest.raises(InteropError, match="sliding_window must be a positive integer"):
        spec.replace(sliding_window=0)


def trainer_logits(store, tokens) -> torch.Tensor:
    """The reference trainer's model (one process, tp 1) on an interop checkpoint: its full logits."""
    from interop.store import StoreReader
    from interop.trainer.checkpoint import load_weights
    from interop.trainer.grid import Grid
    from interop.trainer.model import Stage, attention_mask, rope_tables

    reader = StoreReader(store)
    spec = reader.spec
    grid = Grid(1, 1, 1, 0)
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), grid)
    load_weights(stage, reader, grid)
    with torch.no_grad():
        x = stage.embed(tokens)
        rope = rope_tables(spec, tokens.shape[1])
        mask = attention_mask(spec, tokens.shape[1])
        for block in stage.layers.values():
            x = block(x, rope, mask)
        head = stage.embed.word.weight if spec.tied_embeddings else stage.lm_head.weight
        return torch.nn.functional.linear(stage.final_norm(x), head)[..., :spec.vocab]


@pytest.mark.parametrize("kind", F.KINDS + ["llama3-odd", "llama3-short"])
def test_reference_trainer_logits_equal_transformers(checkpoints, tmp_path, kind):
    """q/k/v biases (Qwen2), q/k norms with head_dim != hidden / heads (Qwen3), llama3 rope scaling
    (Llama-3.1's and other values), a sliding window shorter than the sequence (Mistral): the reference
    trainer's logits equal transformers' within 1e-5 (fp32)."""
    src, logits = checkpoints[kind]
    convert(src, tmp_path / "io", dst_format="interop")
    ours = trainer_logits(tmp_path / "io", TOKENS)
    assert ours.shape == logits.shape
    assert (ours - logits).abs().max().item() < 1e-5


def test_sliding_window_and_rope_scaling_change_the_model(checkpoints, tmp_path):
    """The facts matter at these sizes: the same weights without the window or the scaling give other
    logits (so the equality above cannot pass by ignoring them)."""
    import shutil
    for kind, change in (("mistral", {"sliding_window": None}),
                         ("llama3-short", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})):
        src, logits = checkpoints[kind]
        shutil.copytree(src, tmp_path / kind)
        config = json.loads((src / "config.json").read_text()) | change
        (tmp_path / kind / "config.json").write_text(json.dumps(config))
        convert(tmp_path / kind, tmp_path / f"{kind}-io", dst_format="interop")
        assert (trainer_logits(tmp_path / f"{kind}-io", TOKENS) - logits).abs().max().item() > 1e-3, kind


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "llama3-short"])
def test_parity_tensor_parallel_training(checkpoints, kind):
    """Four updates at tp 1 and tp 2 (Qwen3's q/k norm gradients summed over the ranks' heads; Mistral's
    window; Llama-3 scaling) give transformers' losses within 1e-5."""
    from interop.trainer.config import TrainConfig
    from interop.workflows.parity import parity
    cfg = TrainConfig(steps=4, micro_batch_size=2, global_batch_size=4, seq_length=16, lr=2e-2)
    result = parity(checkpoints[kind][0], cfg, layouts=[(1, 1, 1), (2, 1, 1)], frameworks=["torch", "hf"])
    assert list(result.runs) == ["torch 1x1", "torch 2x1", "hf"]
    assert result.max_diff < 1e-5, result.table()


MEGATRON_FLAGS = {"qwen2": ["--add-qkv-bias", "--disable-bias-linear"], "qwen2-tied": ["--add-qkv-bias"],
                  "qwen3": ["--qk-layernorm", "--kv-channels 24"], "llama3": ["--use-rope-scaling"],
                  "mistral": ["--window-size"], "llama3-odd": ["--use-rope-scaling", "--rope-scaling-factor 16.0"]}


@pytest.mark.parametrize("kind", F.KINDS + ["llama3-odd"])
def test_map_args_carries_each_family_both_ways(checkpoints, tmp_path, kind):
    """config.json -> Megatron args (the family's flags) -> config.json: the same model description,
    read by the converters' own ModelSpec rules; Megatron's args text read back gives the same spec."""
    from interop import mapargs
    src = checkpoints[kind][0] / "config.json"
    result = mapargs.map_args(src, "megatron")
    for flag in MEGATRON_FLAGS[kind]:
        assert flag in result.text, (flag, result.text)
    (tmp_path / "args.sh").write_text(result.text)
    explicit, _, _ = mapargs.read_target(result.text, "megatron")
    _, doc, why = mapargs.to_target(explicit, "hf")
    assert why == {}
    original = json.loads(src.read_text())
    assert doc["model_type"] == original["model_type"]
    want = spec_from_hf_config(original)
    if kind == "llama3-odd":  # Megatron fixes 1 / 4 / 8192, and map-args says so
        lost = [e for e in result.source.entries if e.flag == "rope_parameters"]
        assert lost and "1024" in lost[0].why
        want = want.replace(rope_scaling=llama3_rope_scaling(16.0))
    else:
        assert not [e for e in result.source.entries if e.flag.startswith("rope_parameters")]
    assert spec_from_hf_config(doc) == want
    megatron_spec = spec_from_args(M.complete(explicit), "args")
    assert megatron_spec.replace(padded_vocab=want.padded_vocab, vocab=want.vocab, max_positions=want.max_positions) \
        == want.replace(dtype=megatron_spec.dtype)


@pytest.mark.parametrize("kind", ["qwen2", "qwen2-tied"])
def test_qwen2_mindformers_names(checkpoints, tmp_path, kind):
    """MindFormers' Qwen2 (research/qwen2/convert_weight.py) is its Llama with q/k/v biases: q_proj.bias ->
    attention.wq.bias, no wo / feed_forward biases.  mindspore itself loads the file; back to HF bit-exact."""
    ms = pytest.importorskip("mindspore")
    src = checkpoints[kind][0]
    convert(src, tmp_path / "mf", dst_format="mindspore", options={"dialect": "mindformers"})
    files = sorted((tmp_path / "mf").rglob("*.ckpt"))
    assert files
    names = set(ms.load_checkpoint(str(files[0])))
    for i in range(4):
        assert {f"model.layers.{i}.attention.w{x}.bias" for x in "qkv"} <= names
    assert not any(n.endswith(("wo.bias", "w1.bias", "w2.bias", "w3.bias")) for n in names)
    assert ("lm_head.weight" in names) == (kind == "qwen2")
    convert(tmp_path / "mf", tmp_path / "back", dst_format="hf")
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["qwen2-tied", "qwen3", "mistral", "llama3"])
def test_verify_runs_transformers_and_megatron_core(checkpoints, tmp_path, kind):
    """`interop verify` HF -> Megatron: transformers' class on the source and megatron-core's GPTModel
    (q/k layernorm, rope scaling; Mistral's window as its attention mask) on the converted checkpoint,
    loaded strictly, agree with the reference model within 1e-5."""
    pytest.importorskip("megatron.core")
    from interop.workflows.verify import verify
    convert(checkpoints[kind][0], tmp_path / "meg", dst_format="megatron", tp=2, pp=2)
    result = verify(checkpoints[kind][0], tmp_path / "meg")
    labels = [check.label for check in result.checks]
    assert "transformers, source (hf)" in labels and "megatron-core, converted (megatron)" in labels, labels
    assert result.max_diff < 1e-5, result.lines()


@pytest.mark.parametrize("kind", ["qwen2", "mistral", "llama3-short"])
def test_verify_runs_mindspore(checkpoints, tmp_path, kind):
    """`interop verify` HF -> MindSpore: mindspore loads the converted .ckpt and its model (q/k/v biases,
    the window, llama3 scaling) agrees with transformers and the reference model within 1e-5."""
    pytest.importorskip("mindspore")
    from interop.workflows.verify import verify
    convert(checkpoints[kind][0], tmp_path / "ms", dst_format="mindspore", tp=2)
    result = verify(checkpoints[kind][0], tmp_path / "ms")
    labels = [check.label for check in result.checks]
    assert "interop's model in mindspore ops, converted (mindspore)" in labels and "transformers, source (hf)" in labels, labels
    assert result.max_diff < 1e-5, result.lines()
