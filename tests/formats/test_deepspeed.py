"""`--from deepspeed`: Megatron-DeepSpeed / DeepSpeed pipeline checkpoints, read exactly.

The fixture (tests/fixtures/deepspeed, see its PROVENANCE) was written by DeepSpeed 0.19.8's own
`engine.save_checkpoint` for a PipelineModule laid out as Megatron-DeepSpeed's GPTModelPipe
(megatron/model/gpt_model.py: function at index 0, tied EmbeddingPipe at 1, transformer layers 2..L+1,
final RMSNorm at L+2) over tp 2 x pp 2, ZeRO stage 1, after one Adam step.  Its `reference.safetensors`
holds the full model's weights gathered from every rank's parameters in memory (not from the files):
the expected values.  Fused layouts: megatron/model/transformer.py (query_key_value per query group
[q; k; v] split by `split_tensor`; swiglu dense_h_to_4h chunked in two on each TP rank).
"""
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from interop.cli.main import main
from interop.converters import deepspeed
from interop.formats import detect_format
from interop.errors import InteropError
from interop.io.safe_pickle import safe_torch_load
from interop.workflows.verify import verify

FIXTURE = Path(__file__).parents[1] / "fixtures" / "deepspeed"
REFERENCE = load_file(FIXTURE / "reference.safetensors")
# GPT-2 style (LayerNorm, learned positions, biases, untied LMHeadPipe) at tp 1 x pp 2 x dp 2: file names
# without `-model_YY`, ZeRO state cut over two data-parallel partitions
GPT2 = Path(__file__).parents[1] / "fixtures" / "deepspeed-gpt2"


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_layout_on_disk_is_deepspeeds():
    """What DeepSpeed wrote: `latest` naming the tag folder, a file per layer index and TP rank (index 0, a
    function, and the tied head have none), one engine file per model rank, one ZeRO file per rank."""
    assert (FIXTURE / "latest").read_text() == "global_step1"
    names = sorted(p.name for p in (FIXTURE / "global_step1").iterdir())
    assert [n for n in names if n.startswith("layer_")] == [
        f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(1, 7) for t in range(2)]
    assert [n for n in names if n.startswith("mp_rank_")] == [f"mp_rank_{m:02d}_model_states.pt" for m in range(4)]
    assert [n for n in names if n.startswith("zero_")] == [
        f"zero_pp_rank_0_mp_rank_{m:02d}_optim_states.pt" for m in range(4)]
    # Megatron-DeepSpeed's tracker is there too: deepspeed must be told before megatron
    assert (FIXTURE / "latest_checkpointed_iteration.txt").is_file()
    assert detect_format(FIXTURE) == "deepspeed"
    assert detect_format(FIXTURE / "global_step1") == "deepspeed"


def test_reads_weights_exactly():
    reader = deepspeed.Reader(FIXTURE)
    spec = reader.source.spec
    assert (spec.arch, spec.num_layers, spec.hidden, spec.heads, spec.kv_groups, spec.ffn_hidden) == ("llama", 4, 16, 4, 2, 32)
    assert (spec.norm, spec.activation, spec.position, spec.tied_embeddings) == ("rmsnorm", "swiglu", "rope", True)
    assert reader.source.layout.describe() == "tp=2 pp=2 (pp0: layers 0-1; pp1: layers 2-3)"
    weights = [m for m in reader.metas() if not m.name.startswith("optim.")]
    assert sorted(m.name for m in weights) == sorted(REFERENCE)
    for m in weights:
        got = reader.read(m.name)
        assert got.dtype == torch.float32 and tuple(got.shape) == m.shape
        assert torch.equal(got, REFERENCE[m.name]), m.name
    assert reader.native_name("layers.2.attn.k.weight") == "layer_04-model_00..01: self_attention.query_key_value.weight [part 2/3]"
    reader.close()


@pytest.mark.parametrize("fixture", [FIXTURE, GPT2], ids=["llama-tp2pp2", "gpt2-pp2dp2"])
def test_every_tensor_exact_and_masters_equal_weights(fixture):
    reference = load_file(fixture / "reference.safetensors")
    reader = deepspeed.Reader(fixture)
    metas = reader.metas()
    assert sorted(m.name for m in metas if not m.name.startswith("optim.")) == sorted(reference)
    assert {m.name.split(".")[1] for m in metas if m.name.startswith("optim.")} == {"exp_avg", "exp_avg_sq", "fp32_param"}
    for name, want in reference.items():
        assert torch.equal(reader.read(name), want), name
        assert torch.equal(reader.read(f"optim.fp32_param.{name}"), want), name  # fp32 training: masters == weights


def test_gpt2_layout_and_dp_partitions():
    reader = deepspeed.Reader(GPT2)
    spec = reader.source.spec
    assert (spec.arch, spec.norm, spec.position, spec.activation, spec.tied_embeddings, spec.linear_bias) == (
        "gpt2", "layernorm", "learned", "gelu", False, True)
    assert reader.source.layout.describe() == "tp=1 pp=2 (pp0: layers 0-1; pp1: layers 2-3)"
    assert any("over 2 data-parallel partitions" in n for n in reader.source.notes)
    assert any("bias_gelu_fusion" in n for n in reader.source.notes)
    # the first stage's group flat is partition 0 then partition 1; the word embedding is its first parameter
    flats = []
    for d in (0, 1):
        osd = safe_torch_load(GPT2 / "global_step1" / f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
        flats.append(osd["base_optimizer_state"]["state"][0]["exp_avg_sq"])
    assert list(safe_torch_load(GPT2 / "global_step1" / "mp_rank_00_model_states.pt")["param_shapes"][0])[0] == "1.word_embeddings.weight"
    want = torch.cat(flats)[:64 * 16].view(64, 16)
    assert torch.equal(reader.read("optim.exp_avg_sq.embed.word.weight"), want) and want.abs().sum() > 0


def test_gpt2_to_hf_verifies(tmp_path):
    code, out = run("convert", GPT2, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    result = verify(GPT2, tmp_path / "hf")
    assert result.ok, "\n".join(result.lines())


def test_reads_zero_optimizer_state():
    """fp32 masters equal the (fp32) weights; Adam moments are the ZeRO file's flat slices, per parameter."""
    reader = deepspeed.Reader(FIXTURE)
    state = reader.source.state
    assert state["iteration"] == 1 and state["consumed_samples"] == 2
    assert state["optimizer"]["step"] == 1 and state["optimizer"]["betas"] == [0.9, 0.95]
    assert any("converted the ZeRO optimizer state" in n for n in reader.source.notes)
    for name in REFERENCE:
        assert torch.equal(reader.read(f"optim.fp32_param.{name}"), REFERENCE[name]), name
    # the last stage's files (mp rank 2 = stage 1, tp 0): the final norm is index 6, a replicated tensor
    osd = safe_torch_load(FIXTURE / "global_step1" / "zero_pp_rank_0_mp_rank_02_optim_states.pt")["optimizer_state_dict"]
    frag = osd["param_slice_mappings"][0]["6.weight"].state
    flat = osd["base_optimizer_state"]["state"][0]
    for kind in ("exp_avg", "exp_avg_sq"):
        want = flat[kind][frag["start"]:frag["start"] + frag["numel"]]
        got = reader.read(f"optim.{kind}.final_norm.weight")
        assert torch.equal(got, want) and got.abs().sum() > 0
    # a TP-split tensor: the down projection of layer 3 is cut on its input axis, rank 0 then rank 1
    parts = []
    for mp in (2, 3):
        osd = safe_torch_load(FIXTURE / "global_step1" / f"zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt")["optimizer_state_dict"]
        frag = osd["param_slice_mappings"][0]["5.mlp.dense_4h_to_h.weight"].state
        parts.append(osd["base_optimizer_state"]["state"][0]["exp_avg"][frag["start"]:frag["start"] + frag["numel"]].view(16, 16))
    assert torch.equal(reader.read("optim.exp_avg.layers.3.mlp.down.weight"), torch.cat(parts, dim=1))


def test_to_hf_logits_match_reference(tmp_path):
    """The HF output loads in transformers and gives the logits of an HF Llama built from the reference weights."""
    transformers = pytest.importorskip("transformers")
    code, out = run("convert", FIXTURE, tmp_path / "hf", "--from", "deepspeed", "--to", "hf")
    assert code == 0, out
    assert "optimizer state not written" in out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, rms_norm_eps=1e-5,
                                      rope_theta=10000.0, max_position_embeddings=32, tie_word_embeddings=True,
                                      attention_bias=False, mlp_bias=False)
    ref_model = transformers.LlamaForCausalLM(config).eval()
    hf_names = {"embed.word.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
                 "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
                 "attn.o.weight": "self_attn.o_proj.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                 "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
                 "mlp.down.weight": "mlp.down_proj.weight"}
    sd = {}
    for name, x in REFERENCE.items():
        if name in hf_names:
            sd[hf_names[name]] = x
        else:
            _, i, rest = name.split(".", 2)
            sd[f"model.layers.{i}.{per_layer[rest]}"] = x
    missing, unexpected = ref_model.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ref_model.tie_weights()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    assert (got - want).abs().max().item() <= 1e-5


def test_verify_through_reference_and_transformers(tmp_path):
    code, out = run("convert", FIXTURE, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    result = verify(FIXTURE, tmp_path / "hf")
    assert result.ok, "\n".join(result.lines())


def test_to_interop_carries_the_optimizer(tmp_path):
    code, out = run("convert", FIXTURE, tmp_path / "common", "--to", "interop", "--tp", "1")
    assert code == 0, out
    from interop.converters import interop_format
    back = interop_format.Reader(tmp_path / "common")
    ours = deepspeed.Reader(FIXTURE)
    names = {m.name for m in back.metas()}
    assert {m.name for m in ours.metas()} == names
    for name in names:
        assert torch.equal(back.read(name), ours.read(name)), name
    assert back.source.state["optimizer"]["step"] == 1 and back.source.state["iteration"] == 1


def _copy(tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, dst)
    return dst


def _fails(src, dst, *words):
    code, out = run("convert", src, dst, "--from", "deepspeed", "--to", "hf")
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), out
    for word in words:
        assert word in lines[0], (word, out)
    assert not dst.exists()


def test_bad_inputs_are_one_line(tmp_path):
    ckpt = _copy(tmp_path)
    step = ckpt / "global_step1"
    (step / "layer_03-model_01-model_states.pt").unlink()
    _fails(ckpt, tmp_path / "o1", "layer_03-model_01-model_states.pt is missing")

    ckpt = _copy(tmp_path / "b")
    (ckpt / "latest").write_text("global_step9")
    _fails(ckpt, tmp_path / "o2", "global_step9")

    ckpt = _copy(tmp_path / "c")
    (ckpt / "global_step1" / "mp_rank_00_model_states.pt").unlink()
    _fails(ckpt, tmp_path / "o3", "mp_rank_00_model_states.pt is missing")

    ckpt = _copy(tmp_path / "d")
    (ckpt / "global_step1" / "layer_02-model_00-model_states.pt").write_bytes(b"not a torch file")
    _fails(ckpt, tmp_path / "o4", "layer_02-model_00-model_states.pt")

    ckpt = _copy(tmp_path / "e")
    (ckpt / "latest").write_text("../../elsewhere")  # a tag is a folder name, never a path out
    (ckpt / "global_step1").rename(ckpt / "moved")
    _fails(ckpt, tmp_path / "o5", "latest: does not name a tag folder")

    ckpt = _copy(tmp_path / "f")  # a hostile pickle in place of a layer file is refused, never run
    import pickle
    import os as os_module
    with open(ckpt / "global_step1" / "layer_06-model_01-model_states.pt", "wb") as f:
        pickle.dump(type("Boom", (), {"__reduce__": lambda self: (os_module.system, ("true",))})(), f)
    _fails(ckpt, tmp_path / "o6", "layer_06-model_01-model_states.pt")

    for what, change, words in (("g", lambda a: setattr(a, "num_layers", 6), ["args say num_layers=6"]),
                                 ("h", None, ["no Megatron-DeepSpeed args"]),
                                 ("i", lambda a: setattr(a, "untie_embeddings_and_output_weights", True),
                                  ["untie_embeddings_and_output_weights=True", "do not hold an lm_head"])):
        ckpt = _copy(tmp_path / what)
        engine_file = ckpt / "global_step1" / "mp_rank_00_model_states.pt"
        engine = torch.load(engine_file, weights_only=False)  # our own fixture, rewritten for the case
        if change is None:
            del engine["args"]
        else:
            change(engine["args"])
        torch.save(engine, engine_file)
        _fails(ckpt, tmp_path / f"o-{what}", *words)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert not deepspeed.detect(empty)
    with pytest.raises(InteropError, match="not a DeepSpeed checkpoint"):
        deepspeed.Reader(empty)


def test_optimizer_files_missing_is_a_note(tmp_path):
    ckpt = _copy(tmp_path)
    for p in (ckpt / "global_step1").glob("zero_pp_rank_*"):
        p.unlink()
    reader = deepspeed.Reader(ckpt)
    assert not [m for m in reader.metas() if m.name.startswith("optim.")]
    assert any("optimizer state not converted (no zero_pp_rank_*_optim_states.pt files)" in n for n in reader.source.notes)
    assert torch.equal(reader.read("layers.1.attn.q.weight"), REFERENCE["layers.1.attn.q.weight"])


def test_to_megatron_keeps_moments_and_step(tmp_path):
    """ZeRO's moments reach a Megatron torch checkpoint (resharded to tp 2 / pp 1) and read back unchanged."""
    code, out = run("convert", GPT2, tmp_path / "meg", "--to", "megatron", "--tp", "2")
    assert code == 0, out
    from interop.converters import megatron
    back, ours = megatron.Reader(tmp_path / "meg"), deepspeed.Reader(GPT2)
    for name in ("optim.exp_avg.layers.1.attn.q.bias", "optim.exp_avg_sq.embed.word.weight",
                 "optim.fp32_param.layers.3.mlp.down.weight", "optim.exp_avg.lm_head.weight"):
        got, want = back.read(name), ours.read(name)
        if "embed.word" in name or "lm_head" in name:  # Megatron at tp 2 pads the vocabulary to 256 rows (zeros)
            assert got.shape[0] == 256 and not got[64:].any()
            got = got[:64]
        assert torch.equal(got, want), name
    assert back.source.state["optimizer"]["step"] == 1
