"""MindSpeed's sandwich norm with post-norm scales: the PanGu 38B of the MindSpeed-Core-MS GPT guide
(tests/fixtures/mindspeed_gpt_guide_pangu.md: `use_sandwich_norm`, `attn_post_norm_scale` / `ffn_post_norm_scale`,
62 layers over 4 stages as 16,16,16,14), shrunk to a tiny width with a vocabulary of 250 (not a multiple of 128).

Facts as the sources state them (read at Ascend/MindSpeed-Core-MS commits 3a86578b82b2790176178a54e4f104e1ee583a68
and 5c4f1310e293473ad859702dc59791ad0789d3df):
- mindspeed_ms/legacy/model/transformer.py (3a86578) ParallelTransformerLayer: with config.use_sandwich_norm it
  builds `attn_post_norm = get_norm(config, config.attn_post_norm_scale)` after `input_norm` and `ffn_post_norm =
  get_norm(config, config.ffn_post_norm_scale)` after `post_attention_norm`; construct(): out = attn_post_norm(
  dropout(attention(input_norm(x)))), x1 = x + out; out = ffn_post_norm(dropout(mlp(post_attention_norm(x1)))),
  y = x1 + out.
- mindspeed_ms/legacy/model/norm.py (3a86578) get_norm(config, scale): RMSNorm's weight is
  `initializer("ones", (dim,)) * scale`: the scale is where the weight STARTS, not a factor of the forward; a
  LayerNorm ignores it (the PanGu patch of Megatron's legacy get_norm, tools/rules/line_rules.py at 5c4f131,
  raises "Layernorm only supports the scale value of 1.").  So the scales are ModelSpec init facts
  (`attn_post_norm_scale`, `mlp_post_norm_scale`) and the weights carry the rest.
- tools/rules/line_rules.py (5c4f131) LINE_RULES_megatron["megatron/legacy/model/transformer.py"]: the PanGu
  Megatron legacy layer names the same modules `attn_post_norm` / `ffn_post_norm`; mindspeed_ms/core/config.py
  (3a86578) maps args use_sandwich_norm / attn_post_norm_scale / ffn_post_norm_scale to model_config's same names.
"""
from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

import pytest
import torch

from interop.convert import convert
from interop.errors import InteropError
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreWriter
from interop.tensors import TensorMeta

FIXTURE = Path(__file__).parent.parent / "fixtures" / "mindspeed_gpt_guide_pangu.md"
PANGU = dict(arch="llama", num_layers=62, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=250,
             padded_vocab=256, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
             tied_embeddings=False, pre_norm=True, post_norm=True, attn_post_norm_scale=0.0447,
             mlp_post_norm_scale=0.0825)
SPLIT = dict(tp=2, pp=4, first_stage_layers=16, last_stage_layers=14)  # num_layer_list 16,16,16,14


def write_common(spec: ModelSpec, dst: Path) -> Path:
    """A common-format checkpoint of `spec` with every tensor random (norms around 1, each unlike the others, so a
    swapped norm shows; matrices at a trained model's scale)."""
    gen = torch.Generator().manual_seed(7)
    table = param_table(spec)
    dst.mkdir()
    writer = StoreWriter(dst, spec, ParallelLayout.build(spec.num_layers), [TensorMeta(p.name, torch.float32, p.shape)
                                                                            for p in table])
    for p in table:
        noise = torch.randn(p.shape, generator=gen)
        writer.write(p.name, 1 + 0.2 * noise if "norm" in p.name else 0.05 * noise)
    writer.finish({})
    return dst


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def records(path: Path) -> dict[str, bytes]:
    """A torch.save zip's records but its random serialization id and its pickle (compared loaded: a source's args
    that share one string object pickle it as a memo reference, the same args read back do not)."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i) for i in z.infolist()
                if not i.filename.endswith((".data/serialization_id", "/data.pkl"))}


def assert_same_megatron(a: Path, b: Path) -> None:
    ours, theirs = files(a), files(b)
    assert ours.keys() == theirs.keys()
    for name in ours:
        if not name.endswith(".pt"):
            assert ours[name] == theirs[name], name
            continue
        assert records(a / name) == records(b / name), name  # every tensor's bytes, at the same record
        x, y = torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False)
        assert list(vars(x.pop("args")).items()) == list(vars(y.pop("args")).items()), name  # values and order
        assert list(x) == list(y) and list(x["model"]) == list(y["model"]), name
        assert x["iteration"] == y["iteration"] and x["checkpoint_version"] == y["checkpoint_version"]


def test_the_guide_excerpt_is_in_the_repo():
    text = FIXTURE.read_text()
    for fact in ("use_sandwich_norm", "attn_post_norm_scale", "ffn_post_norm_scale", "num_layer_list",
                 "post_norm_scale: 0.0447", "post_norm_scale: 0.0825", "num_layers: 62", "[16,16,16,14]"):
        assert fact in text, fact


@pytest.fixture(scope="module")
def pangu(tmp_path_factory):
    root = tmp_path_factory.mktemp("pangu")
    spec = ModelSpec(**PANGU)
    write_common(spec, root / "common")
    convert(root / "common", root / "megatron", dst_format="megatron", iteration=100, **SPLIT)  # a trained one
    return spec, root


def test_megatron_to_mindspeed_and_back_byte_identical(pangu, tmp_path):
    """Megatron torch (tp 2, stages 16/16/16/14) -> MindSpeed-Core-MS -> Megatron torch: every tensor's bytes in the
    same record of the same file, the same args in the same order, the same tracker."""
    spec, root = pangu
    meg = root / "megatron"
    args = vars(torch.load(meg / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["args"])
    assert (args["pre_norm"], args["post_norm"]) == (True, True)
    assert (args["attn_post_norm_scale"], args["ffn_post_norm_scale"]) == (0.0447, 0.0825)
    assert (args["decoder_first_pipeline_num_layers"], args["decoder_last_pipeline_num_layers"]) == (16, 14)
    convert(meg, tmp_path / "ms", dst_format="mindspore", dialect="mindspeed", **SPLIT)
    convert(tmp_path / "ms", tmp_path / "back", dst_format="megatron", **SPLIT)
    assert_same_megatron(meg, tmp_path / "back")


def test_mindspeed_files_hold_the_sandwich_under_its_model_names(pangu, tmp_path):
    """Each stage's rank file holds its global layers' attn_post_norm / ffn_post_norm (the model's names), equal to
    the source's tensors; the sidecar keeps the scales; the last stage holds layers 48..61."""
    ms = pytest.importorskip("mindspore")
    spec, root = pangu
    convert(root / "megatron", tmp_path / "ms", dst_format="mindspore", dialect="mindspeed", **SPLIT)
    convert(tmp_path / "ms", tmp_path / "common", dst_format="interop")
    manifest = json.loads((tmp_path / "common" / "interop.json").read_text())
    assert manifest["spec"]["attn_post_norm_scale"] == 0.0447 and manifest["spec"]["mlp_post_norm_scale"] == 0.0825
    from interop.store import StoreReader  # the round trip's tensors against the source's
    a, b = StoreReader(root / "common"), StoreReader(tmp_path / "common")
    for name in ("layers.0.attn_post_norm.weight", "layers.61.mlp_post_norm.weight", "layers.30.attn.q.weight"):
        assert torch.equal(a.read(name), b.read(name)), name
    # pt_meta/ (convert_ckpt2pt.py's args for the Megatron legacy model it rebuilds): PanGu's sandwich flags
    meta = vars(torch.load(tmp_path / "ms" / "pt_meta" / "args_tp00_pp003.pt", weights_only=False)["args"])
    assert (meta["use_sandwich_norm"], meta["attn_post_norm_scale"], meta["ffn_post_norm_scale"]) == (True, 0.0447, 0.0825)
    # rank r = pp_rank * tp + tp_rank (dp 1): stage 3 is rank_6 / rank_7
    last = ms.load_checkpoint(str(tmp_path / "ms" / "rank_6" / "network.ckpt"))
    layers = sorted({int(k.split(".")[3]) for k in last if k.startswith("language_model.encoder.layers.")})
    assert layers == list(range(48, 62))
    for i in (48, 61):
        for ms_name, canonical in (("attn_post_norm", "attn_post_norm"), ("ffn_post_norm", "mlp_post_norm")):
            value = last[f"language_model.encoder.layers.{i}.{ms_name}.weight"].asnumpy()
            assert (torch.from_numpy(value) == a.read(f"layers.{i}.{canonical}.weight")).all()


def test_mindspeed_refuses_facts_its_model_cannot_compute(tmp_path):
    """A post norm without the pre norms (OLMo 2) or Gemma's (1 + w) norms: one line naming the fact."""
    for change, fact in ((dict(pre_norm=False, attn_post_norm_scale=None, mlp_post_norm_scale=None), "pre_norm"),
                         (dict(norm_zero_centered=True), "norm_zero_centered")):
        spec = ModelSpec(**{**PANGU, "num_layers": 2, **change})
        write_common(spec, tmp_path / fact)
        with pytest.raises(InteropError, match=f"mindspeed names hold no {fact}="):
            convert(tmp_path / fact, tmp_path / f"{fact}-ms", dst_format="mindspore", dialect="mindspeed")
        assert not (tmp_path / f"{fact}-ms").exists()


def test_scale_facts_are_checked():
    with pytest.raises(InteropError, match="needs post_norm"):
        ModelSpec(**{**PANGU, "post_norm": False})
    with pytest.raises(InteropError, match="a LayerNorm takes only 1.0"):
        ModelSpec(**{**PANGU, "norm": "layernorm"})
    assert ModelSpec(**PANGU) == ModelSpec(**{**PANGU, "attn_post_norm_scale": None})  # init facts, not identity


def pangu_legacy(common: Path, dst: Path, spec: ModelSpec, counts=(16, 16, 16, 14), tp: int = 2,
                 iteration: int = 100) -> Path:
    """The PanGu Megatron legacy checkpoint, written here independently of interop's writers: Megatron's legacy
    GPTModel state (language_model.{embedding, encoder, output_layer}, layer numbers local to each stage, QKV
    grouped per query group, dense_h_to_4h = [gate_r; up_r]) plus the sandwich norms as MindSpeed-Core-MS's patch
    names them (`attn_post_norm`, `ffn_post_norm`), and the guide's args (use_sandwich_norm, the scales,
    num_layer_list)."""
    from interop.store import StoreReader
    src = StoreReader(common)
    t = {m.name: src.read(m.name) for m in src.metas()}
    per, d = spec.heads // spec.kv_groups, spec.head_dim

    def rows(x, r):
        n = x.shape[0] // tp
        return x[r * n:(r + 1) * n]

    def cols(x, r):
        n = x.shape[1] // tp
        return x[:, r * n:(r + 1) * n]

    def qkv(i, r):
        q, k, v = (t[f"layers.{i}.attn.{x}.weight"] for x in "qkv")
        out = []
        for g in range(r * spec.kv_groups // tp, (r + 1) * spec.kv_groups // tp):
            out += [q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
        return torch.cat(out)

    args = argparse.Namespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden, ffn_hidden_size=spec.ffn_hidden,
        num_attention_heads=spec.heads, group_query_attention=True, num_query_groups=spec.kv_groups,
        kv_channels=spec.head_dim, padded_vocab_size=spec.padded_vocab, max_position_embeddings=spec.max_positions,
        seq_length=spec.max_positions, position_embedding_type="rope", rotary_base=10000, normalization="RMSNorm",
        norm_epsilon=spec.norm_eps, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, use_sandwich_norm=True, attn_post_norm_scale=0.0447,
        ffn_post_norm_scale=0.0825, tensor_model_parallel_size=tp, pipeline_model_parallel_size=len(counts),
        num_layer_list=",".join(map(str, counts)), params_dtype=torch.float32, use_mcore_models=False,
        use_legacy_models=True, iteration=iteration)
    folder = dst / f"iter_{iteration:07d}"
    for p, n in enumerate(counts):
        start = sum(counts[:p])
        for r in range(tp):
            encoder = {}
            for local in range(n):
                i, pre = start + local, f"layers.{local}."
                encoder |= {pre + "input_norm.weight": t[f"layers.{i}.attn_norm.weight"],
                            pre + "self_attention.query_key_value.weight": qkv(i, r),
                            pre + "self_attention.dense.weight": cols(t[f"layers.{i}.attn.o.weight"], r),
                            pre + "attn_post_norm.weight": t[f"layers.{i}.attn_post_norm.weight"],
                            pre + "post_attention_norm.weight": t[f"layers.{i}.mlp_norm.weight"],
                            pre + "mlp.dense_h_to_4h.weight": torch.cat([rows(t[f"layers.{i}.mlp.gate.weight"], r),
                                                                         rows(t[f"layers.{i}.mlp.up.weight"], r)]),
                            pre + "mlp.dense_4h_to_h.weight": cols(t[f"layers.{i}.mlp.down.weight"], r),
                            pre + "ffn_post_norm.weight": t[f"layers.{i}.mlp_post_norm.weight"]}
            language_model = {"encoder": encoder}
            if p == 0:
                language_model["embedding"] = {"word_embeddings": {"weight": rows(t["embed.word.weight"], r)}}
            if p == len(counts) - 1:
                encoder["final_norm.weight"] = t["final_norm.weight"]
                language_model["output_layer"] = {"weight": rows(t["lm_head.weight"], r)}
            rank = folder / f"mp_rank_{r:02d}_{p:03d}"
            rank.mkdir(parents=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                        "model": {"language_model": language_model}}, rank / "model_optim_rng.pt")
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def test_pangu_legacy_megatron_reads_to_mindspeed_exactly(pangu, tmp_path):
    """The guide's Megatron form (legacy names, use_sandwich_norm, num_layer_list 16,16,16,14, tp 2) -> MindSpeed-Core-MS
    at the same split -> the common format: every tensor equal to the source's, the scales and split kept."""
    from interop.store import StoreReader
    spec, root = pangu
    legacy = pangu_legacy(root / "common", tmp_path / "legacy", spec)
    # the args state the padded rows only (padded_vocab_size 256): the tokenizer's 250 is given
    convert(legacy, tmp_path / "ms", dst_format="mindspore", dialect="mindspeed", vocab_size=250, **SPLIT)
    convert(tmp_path / "ms", tmp_path / "common", dst_format="interop")
    a, b = StoreReader(root / "common"), StoreReader(tmp_path / "common")
    assert b.source.spec == spec
    assert (b.source.spec.attn_post_norm_scale, b.source.spec.mlp_post_norm_scale) == (0.0447, 0.0825)
    for m in a.metas():
        assert torch.equal(a.read(m.name), b.read(m.name)), m.name
    # and to megatron-core names (Megatron-Bridge's post_layernorm), which read back to the same tensors
    convert(legacy, tmp_path / "mcore", dst_format="megatron", vocab_size=250, **SPLIT)
    convert(tmp_path / "mcore", tmp_path / "common2", dst_format="interop")
    c = StoreReader(tmp_path / "common2")
    for m in a.metas():
        assert torch.equal(a.read(m.name), c.read(m.name)), m.name


def test_mindspore_ops_model_computes_the_sandwich(tmp_path):
    """The MindSpeed files, loaded by mindspore.load_checkpoint and run with MindSpore's own ops (interop's stand-in
    for MindSpeed-Core-MS, which is not on PyPI), give the reference trainer's logits on the same weights."""
    pytest.importorskip("mindspore")
    import numpy as np
    import torch.nn.functional as F
    from interop.store import StoreReader
    from interop.trainer.grid import Grid
    from interop.trainer.model import Stage
    from interop.workflows import mindspore_model
    spec = ModelSpec(**{**PANGU, "num_layers": 3, "hidden": 32, "ffn_hidden": 64, "head_dim": 8})
    write_common(spec, tmp_path / "common")
    convert(tmp_path / "common", tmp_path / "ms", dst_format="mindspore", dialect="mindspeed")
    tokens = np.random.default_rng(1).integers(0, spec.vocab, (2, 10))
    theirs = mindspore_model.logits(mindspore_model.load(tmp_path / "ms"), tokens).asnumpy()
    store = StoreReader(tmp_path / "common")
    stage = Stage(spec, ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    with torch.no_grad():
        for name, value in stage.named_tensors():
            value.copy_(store.read(name))
        x = torch.from_numpy(tokens)
        ours = F.linear(stage.final_norm(stage.blocks(stage.embed(x))), stage.lm_head.weight)[..., :spec.vocab]
    assert np.abs(ours.numpy() - theirs).max() < 1e-5
    # without the post norms it would be another model: the check can fail
    plain = Stage(spec.replace(post_norm=False, attn_post_norm_scale=None, mlp_post_norm_scale=None),
                  ParallelLayout.build(spec.num_layers), Grid(1, 1, 1, 0))
    with torch.no_grad():
        for name, value in plain.named_tensors():
            value.copy_(store.read(name))
        other = F.linear(plain.final_norm(plain.blocks(plain.embed(x))), plain.lm_head.weight)[..., :spec.vocab]
    assert np.abs(other.numpy() - theirs).max() > 1e-3
    from interop.workflows.verify import verify  # and `verify` runs the MindSpore checkpoint in MindSpore's ops
    result = verify(tmp_path / "common", tmp_path / "ms")
    assert result.ok and not any("does not compute" in line for line in result.lines()), result.lines()



def test_torch_dist_to_mindspeed_and_back(pangu, tmp_path):
    """torch_dist at the same split -> MindSpeed-Core-MS -> torch_dist -> common: every tensor as the source's."""
    from interop.store import StoreReader
    spec, root = pangu
    convert(root / "megatron", tmp_path / "dist", dst_format="megatron", format="torch_dist", **SPLIT)
    convert(tmp_path / "dist", tmp_path / "ms", dst_format="mindspore", dialect="mindspeed", **SPLIT)
    convert(tmp_path / "ms", tmp_path / "dist2", dst_format="megatron", format="torch_dist", **SPLIT)
    convert(tmp_path / "dist2", tmp_path / "common", dst_format="interop")
    a, b = StoreReader(root / "common"), StoreReader(tmp_path / "common")
    assert b.source.spec == spec and b.source.spec.mlp_post_norm_scale == 0.0825
    for m in a.metas():
        assert torch.equal(a.read(m.name), b.read(m.name)), m.name


def test_the_guides_yaml_describes_the_sandwich_model():
    """The guide's model_38BV3 YAML (tests/fixtures/args/seed001_model_38BV3.yaml, as --model-config of a MindSpeed
    checkpoint): 62 RMSNorm layers with the four norms and the guide's scales, GQA 48 / 8, untied."""
    from interop.mappings.megatron_spec import spec_from_args
    from interop.model_config import megatron_args_from_file
    path = Path(__file__).parent.parent / "fixtures" / "args" / "seed001_model_38BV3.yaml"
    spec = spec_from_args(megatron_args_from_file(path), str(path))
    assert (spec.num_layers, spec.hidden, spec.heads, spec.kv_groups, spec.norm) == (62, 6144, 48, 8, "rmsnorm")
    assert (spec.pre_norm, spec.post_norm, spec.tied_embeddings) == (True, True, False)
    assert (spec.attn_post_norm_scale, spec.mlp_post_norm_scale) == (0.0447, 0.0825)
