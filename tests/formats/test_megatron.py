"""Megatron-LM `torch` checkpoints: hand-built fixtures read bit-exact, the writer reproduces them, round trips.

The fixtures here are built by direct indexing (fused QKV per query group, SwiGLU fc1
as [gate_r; up_r] per rank, padded vocab, local layer numbers, tied head copy), not
through interop's own fused/name tables, so reader and writer bugs cannot cancel out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from interop.convert import convert
from interop.errors import InteropError
from interop.describe import describe
from helpers.megatron_built import VOCAB, megatron_args, hand_built



def hf_model(kind: str, act: str = "gelu_new", seed: int = 0):
    """8 layers (pp 1, 2, 4 and vpp 2), GQA for llama, a vocabulary that needs padding."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=8, n_embd=32, n_head=4, n_inner=64, vocab_size=VOCAB, n_positions=32,
                                      activation_function=act, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
                                       intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=32,
                                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


















def hf_tensors(path):
    return load_file(str(path / "model.safetensors"))


def assert_same_hf(a, b):
    ta, tb = hf_tensors(a), hf_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def rank_tensors(root):
    """{(rank folder, chunk key, flattened name): tensor} of every tensor in a Megatron save dir."""
    out = {}
    for f in sorted(root.glob("*/mp_rank_*/model_optim_rng.pt")):
        obj = torch.load(f, weights_only=False)
        for chunk in [k for k in obj if k.startswith("model") and k != "model_optim_rng"]:
            def walk(d, prefix=""):
                for k, v in d.items():
                    if isinstance(v, dict):
                        walk(v, prefix + k + ".")
                    elif isinstance(v, torch.Tensor):
                        out[(f.parent.name, chunk, prefix + k)] = v
            walk(obj[chunk])
    return out


def assert_same_megatron(a, b):
    ta, tb = rank_tensors(a), rank_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in ("gpt2", "llama"):
        m = hf_model(kind)
        m.save_pretrained(root / kind)
        out[kind] = (m, root / kind)
    return out


@pytest.mark.parametrize("kind,scheme", [("gpt2", "mcore"), ("llama", "mcore"), ("gpt2", "te"), ("llama", "te"),
                                         ("gpt2", "legacy"), ("llama", "legacy")])
def test_hand_built_reads_bit_exact(tmp_path, models, kind, scheme):
    model, hf = models[kind]
    src = hand_built(tmp_path / "meg", model, kind, tp=2, pp=2, scheme=scheme)
    summary = convert(src, tmp_path / "hf", dst_format="hf")
    assert_same_hf(hf, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == VOCAB
    assert any("padding rows" in n for n in summary.notes)  # the random padding rows are reported when dropped
    if kind == "gpt2":
        assert any("tied embedding" in n for n in summary.notes)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_writer_reproduces_hand_built(tmp_path, models, kind):
    model, hf = models[kind]
    ref = hand_built(tmp_path / "ref", model, kind, tp=2, pp=2, vpp=2)
    convert(hf, tmp_path / "out", dst_format="megatron", tp=2, pp=2, vpp=2)
    got, want = rank_tensors(tmp_path / "out"), rank_tensors(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        if "word_embeddings" in k[2] or k[2] == "output_layer.weight":  # HF has no padding rows: they come back zero
            t = int(k[0][len("mp_rank_"):len("mp_rank_") + 2])
            real = max(0, min(128, VOCAB - t * 128))
            assert torch.equal(got[k][:real], want[k][:real]) and not got[k][real:].any(), k
            continue
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_round_trips_bit_exact(tmp_path, models, kind):
    model, hf = models[kind]
    src = hand_built(tmp_path / "m22", model, kind, tp=2, pp=2, iteration=40)
    convert(src, tmp_path / "hf1", dst_format="hf")
    convert(tmp_path / "hf1", tmp_path / "m14", dst_format="megatron", tp=1, pp=4)
    convert(tmp_path / "m14", tmp_path / "m22v", dst_format="megatron", tp=2, pp=2, vpp=2)
    convert(tmp_path / "m22v", tmp_path / "store", dst_format="interop", tp=2)
    convert(tmp_path / "store", tmp_path / "m11", dst_format="megatron")
    convert(tmp_path / "m11", tmp_path / "hf2", dst_format="hf")
    assert_same_hf(hf, tmp_path / "hf1")
    assert_same_hf(hf, tmp_path / "hf2")
    # Megatron -> Megatron keeps everything, padding rows included, and comes back to the same files
    convert(src, tmp_path / "a14", dst_format="megatron", tp=1, pp=4)
    convert(tmp_path / "a14", tmp_path / "a22v", dst_format="megatron", tp=2, pp=4 // 2, vpp=2)
    convert(tmp_path / "a22v", tmp_path / "a22", dst_format="megatron", tp=2, pp=2)
    got = rank_tensors(tmp_path / "a22")
    want = rank_tensors(src)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert (tmp_path / "a22" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"


def test_vocab_padding_grows_exactly(tmp_path, models, monkeypatch):
    """Padding vocab rows (HF 250 -> Megatron tp 2's 256 -> tp 4's 512) reads the rows straight into the padded
    tensor: the source's rows (its padding included), then zeros; every step gives the same HF model."""
    from interop.converters import hf as hf_converter
    from interop.converters.megatron.torch_format import Reader
    from interop.store import StoreReader
    model, hf = models["gpt2"]
    filled = []
    for cls in (Reader, hf_converter.Reader):
        original = cls.read_into
        monkeypatch.setattr(cls, "read_into", lambda self, name, out, original=original:
                            filled.append((type(self).__module__, name)) or original(self, name, out))
    convert(hf, tmp_path / "m22", dst_format="megatron", tp=2, pp=2)
    convert(tmp_path / "m22", tmp_path / "m41", dst_format="megatron", tp=4, pp=1)
    assert [m for m, n in filled if n == "embed.word.weight"] == [hf_converter.__name__, Reader.__module__]
    before, after = rank_tensors(tmp_path / "m22"), rank_tensors(tmp_path / "m41")
    key = "embedding.word_embeddings.weight"
    old = torch.cat([before[(f"mp_rank_{t:02d}_000", "model", key)] for t in range(2)])
    new = torch.cat([after[(f"mp_rank_{t:02d}", "model", key)] for t in range(4)])
    assert old.shape[0] == 256 and new.shape[0] == 512
    assert torch.equal(new[:256], old) and not new[256:].any()
    convert(tmp_path / "m41", tmp_path / "hf-again", dst_format="hf")
    assert_same_hf(hf, tmp_path / "hf-again")
    convert(hf, tmp_path / "store", dst_format="interop", tp=2)  # the common format keeps HF's 250 rows
    filled.clear()
    monkeypatch.setattr(StoreReader, "read_into", lambda self, name, out, original=StoreReader.read_into:
                        filled.append(name) or original(self, name, out))
    convert(tmp_path / "store", tmp_path / "m22-again", dst_format="megatron", tp=2, pp=2)
    assert "embed.word.weight" in filled
    assert_same_megatron(tmp_path / "m22", tmp_path / "m22-again")


def test_written_checkpoint_is_complete(tmp_path, models):
    model, hf = models["llama"]
    convert(hf, tmp_path / "m", dst_format="megatron", tp=2, pp=2)
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    obj = torch.load(tmp_path / "m" / "release" / "mp_rank_01_001" / "model_optim_rng.pt", weights_only=False)
    assert obj["checkpoint_version"] == 3.0 and obj["iteration"] == 0
    a = obj["args"]
    assert isinstance(a, argparse.Namespace)
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups) == (8, 32, 48, 4, 2)
    assert a.group_query_attention and a.swiglu and a.normalization == "RMSNorm" and a.position_embedding_type == "rope"
    assert a.untie_embeddings_and_output_weights and not a.add_bias_linear
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (2, 2)
    assert (a.vocab_size, a.padded_vocab_size, a.make_vocab_size_divisible_by) == (VOCAB, 256, 128)
    assert a.params_dtype is torch.float32 and a.transformer_impl == "local"
    assert obj["model"]["output_layer.weight"].shape == (128, 32)
    assert "decoder.layers.3.mlp.linear_fc2._extra_state" in obj["model"]
    assert "decoder.layers.4.input_layernorm.weight" not in obj["model"]  # local layer numbers: 0..3 per stage


@pytest.mark.parametrize("openai_gelu,fusion,expected", [(False, False, "gelu"), (True, False, "gelu_new"),
                                                          (False, True, "gelu_new")])
def test_gelu_flavour(tmp_path, openai_gelu, fusion, expected):
    """Megatron's exact GeLU is HF `gelu`; --openai-gelu or the fused bias-GeLU is the tanh form, `gelu_new`."""
    exact = hf_model("gpt2", act="gelu")
    with torch.no_grad():  # pre-activations well away from 0, where the two GeLUs part
        for layer in exact.transformer.h:
            layer.mlp.c_fc.weight.mul_(30)
    tanh = transformers.GPT2LMHeadModel(transformers.GPT2Config(**(exact.config.to_dict() | {"activation_function": "gelu_new"})))
    tanh.load_state_dict(exact.state_dict())
    tanh.eval()
    args = megatron_args(exact, "gpt2", 1, 1, openai_gelu=openai_gelu, bias_gelu_fusion=fusion)
    hand_built(tmp_path / "m", exact, "gpt2", tp=1, pp=1, args=args)
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == expected
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want_exact, want_tanh = converted(ids).logits, exact(ids).logits, tanh(ids).logits
    assert not torch.equal(want_exact, want_tanh)  # the two GeLUs really differ on this model
    assert (want_exact - want_tanh).abs().max() > 5e-6  # small (~2e-5): only an exact test sees it
    assert torch.equal(got, want_exact if expected == "gelu" else want_tanh)


def test_args_from_other_tools(tmp_path, models):
    """SimpleNamespace args without derived fields, classes from absent packages, a dummy optimizer."""
    model, hf = models["gpt2"]
    a = megatron_args(model, "gpt2", 2, 2)
    a.pop("kv_channels")
    a["ffn_hidden_size"] = None  # means 4 * hidden (= 128 here): make the model match that
    a["padded_vocab_size"] = None
    cfg = model.config.to_dict() | {"n_inner": None}
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "mlp" not in k}, strict=False)
    plain.save_pretrained(tmp_path / "hf0")
    hand_built(tmp_path / "m", plain, "gpt2", tp=2, pp=2, args=types.SimpleNamespace(**a))
    sys.modules[_ForeignThing.__module__] = types.ModuleType(_ForeignThing.__module__)
    sys.modules[_ForeignThing.__module__]._ForeignThing = _ForeignThing
    for f in (tmp_path / "m" / "release").glob("*/model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        obj["optimizer"] = None
        obj["args"].custom = _ForeignThing(3)
        torch.save(obj, f)
    sys.modules.pop(_ForeignThing.__module__, None)  # the package is now absent, as on a user's machine
    summary = convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")
    assert_same_hf(tmp_path / "hf0", tmp_path / "hf")
    assert any("optimizer" in n for n in summary.notes)


class _ForeignThing:
    def __init__(self, x):
        self.x = x


_ForeignThing.__module__ = "some_absent_package_things"


def test_no_args_needs_model_config(tmp_path, models):
    model, hf = models["llama"]
    hand_built(tmp_path / "m", model, "llama", tp=2, pp=2)
    for f in (tmp_path / "m" / "release").glob("*/model_optim_rng.pt"):
        obj = torch.load(f, weights_only=False)
        del obj["args"]
        torch.save(obj, f)
    with pytest.raises(InteropError, match="no model description.*--model-config"):
        convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")
    summary = convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", options={"model_config": str(hf / "config.json")})
    assert_same_hf(hf, tmp_path / "hf")
    assert any("model description taken from" in n for n in summary.notes)


def test_uneven_stages_round_trip(tmp_path, models):
    model, hf = models["gpt2"]
    convert(hf, tmp_path / "m", dst_format="megatron", tp=2, pp=3, first_stage_layers=2, last_stage_layers=2)
    info = describe(tmp_path / "m")
    assert info["layout"].startswith("tp=2 pp=3") and "pp0: layers 0-1" in info["layout"] and "pp1: layers 2-5" in info["layout"]
    obj = torch.load(tmp_path / "m" / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert obj["args"].decoder_first_pipeline_num_layers == 2 and obj["args"].decoder_last_pipeline_num_layers == 2
    convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")
    assert_same_hf(hf, tmp_path / "hf")


def test_inspect_cli(tmp_path, models):
    model, hf = models["llama"]
    hand_built(tmp_path / "m", model, "llama", tp=2, pp=2, iteration=7)
    run = subprocess.run([sys.executable, "-m", "interop", "inspect", str(tmp_path / "m"), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["format"] == "megatron" and info["state"]["iteration"] == 7
    assert info["layout"].startswith("tp=2 pp=2")
    assert info["spec"]["kv_groups"] == 2 and info["spec"]["padded_vocab"] == 256 and info["spec"]["vocab"] == VOCAB
    assert info["state"]["megatron"]["args"]["num_layers"] == 8
    assert info["state"]["megatron"]["scheme"] == "mcore"


def _one_line_error(*argv):
    run = subprocess.run([sys.executable, "-m", "interop", *map(str, argv)], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    return run.stderr


def test_bad_checkpoints(tmp_path, models):
    model, hf = models["llama"]
    good = hand_built(tmp_path / "good", model, "llama", tp=2, pp=2, iteration=5)
    # a missing rank folder
    import shutil
    shutil.copytree(good, tmp_path / "missing")
    shutil.rmtree(tmp_path / "missing" / "iter_0000005" / "mp_rank_01_001")
    err = _one_line_error("convert", tmp_path / "missing", tmp_path / "o1", "--to", "hf", "-q")
    assert "mp_rank_01_001 is missing" in err and not (tmp_path / "o1").exists()
    # a tracker naming an iteration that is not there
    shutil.copytree(good, tmp_path / "tracker")
    (tmp_path / "tracker" / "latest_checkpointed_iteration.txt").write_text("6")
    assert "iter_0000006, which does not exist" in _one_line_error("convert", tmp_path / "tracker", tmp_path / "o2",
                                                                   "--to", "hf", "-q")
    # shapes that disagree with args
    shutil.copytree(good, tmp_path / "shape")
    f = tmp_path / "shape" / "iter_0000005" / "mp_rank_00_001" / "model_optim_rng.pt"
    obj = torch.load(f, weights_only=False)
    obj["args"].ffn_hidden_size = 64
    torch.save(obj, f)
    f0 = tmp_path / "shape" / "iter_0000005" / "mp_rank_00_000" / "model_optim_rng.pt"
    obj0 = torch.load(f0, weights_only=False)
    obj0["args"].ffn_hidden_size = 64
    torch.save(obj0, f0)
    err = _one_line_error("convert", tmp_path / "shape", tmp_path / "o3", "--to", "hf", "-q")
    assert "linear_fc1.weight has shape [48, 32], args imply [64, 32]" in err
    # a truncated rank file
    shutil.copytree(good, tmp_path / "trunc")
    f = tmp_path / "trunc" / "iter_0000005" / "mp_rank_01_000" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert "mp_rank_01_000" in _one_line_error("convert", tmp_path / "trunc", tmp_path / "o4", "--to", "hf", "-q")
    # --iteration that does not exist
    assert "iter_0000009" in _one_line_error("convert", good, tmp_path / "o5", "--to", "hf", "--iteration", 9, "-q")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_torch_dist_through_the_megatron_format(tmp_path, models, kind):
    """`--from megatron --to megatron --format torch_dist` writes DCP; `--from megatron` reads it back bit-exact."""
    from click.testing import CliRunner

    from interop.cli.main import main

    model, hf = models[kind]
    src = hand_built(tmp_path / "m22", model, kind, tp=2, pp=2, iteration=40)
    run = lambda *a: CliRunner().invoke(main, [str(x) for x in a])  # noqa: E731
    result = run("convert", src, tmp_path / "dist", "--from", "megatron", "--to", "megatron", "--format", "torch_dist")
    assert result.exit_code == 0, result.output
    folder = tmp_path / "dist" / "iter_0000040"
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in folder.iterdir()}
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    result = run("inspect", tmp_path / "dist", "--no-tensors")
    assert result.exit_code == 0 and "layout: tp=1 pp=1" in result.output  # written at the default tp 1 / pp 1
    result = run("convert", tmp_path / "m22", tmp_path / "dist22", "--from", "megatron", "--to", "megatron",
                 "--format", "torch_dist", "--tp", 2, "--pp", 2)
    assert result.exit_code == 0, result.output
    result = run("inspect", tmp_path / "dist22", "--no-tensors")
    assert "layout: tp=2 pp=2" in result.output, result.output  # the layout its args say it was saved at
    result = run("convert", tmp_path / "dist", tmp_path / "back", "--from", "megatron", "--to", "megatron",
                 "--tp", 2, "--pp", 2)
    assert result.exit_code == 0, result.output
    assert_same_megatron(src, tmp_path / "back")
    convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")  # detected as megatron
    assert_same_hf(hf, tmp_path / "hf")


def add_optimizer(root, tp, pp, step=40, scheduler=None, distrib=False):
    """Give each rank file of a hand-built checkpoint Megatron's non-distributed Adam state: params
    numbered in model order within [decay, no-decay] groups; replicated (1-D) moments equal over TP."""
    import zlib

    scheduler = scheduler or {"max_lr": 3e-4, "num_steps": step * 8, "warmup_steps": 10}
    for f in sorted(root.glob("*/mp_rank_*/model_optim_rng.pt")):
        obj = torch.load(f, weights_only=False)
        t = int(f.parent.name[8:10])
        params = [(k, v) for c in sorted(k for k in obj if k.startswith("model")) for k, v in obj[c].items()
                  if isinstance(v, torch.Tensor)]
        groups = [[(k, v) for k, v in params if v.dim() > 1], [(k, v) for k, v in params if v.dim() == 1]]
        state, ids, masters, i = {}, [], [], 0
        for members in groups:
            ids.append([])
            masters.append([])
            for k, v in members:
                g = torch.Generator().manual_seed(zlib.crc32(f"{f.parent.name if v.dim() > 1 else f.parent.name[10:]}/{k}".encode()))
                state[i] = {"step": torch.tensor(float(step)), "exp_avg": torch.randn(v.shape, generator=g),
                            "exp_avg_sq": torch.rand(v.shape, generator=g)}
                masters[-1].append(torch.randn(v.shape, generator=g))
                ids[-1].append(i)
                i += 1
        base = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        obj["optimizer"] = {"optimizer": {"state": state, "param_groups": [
            dict(base, wd_mult=1.0, params=ids[0]), dict(base, wd_mult=0.0, params=ids[1])]},
            "fp32_from_fp16_params": masters}
        obj["opt_param_scheduler"] = scheduler
        torch.save(obj, f)
        if distrib:
            torch.save({"param_state": torch.zeros(10)}, f.parent / "distrib_optim.pt")
        assert t < tp
    return root


def optimizer_of(root):
    """{(rank folder, param key): {kind: tensor}} plus every rank's step and scheduler."""
    out, steps, scheds = {}, set(), []
    for f in sorted(root.glob("*/mp_rank_*/model_optim_rng.pt")):
        obj = torch.load(f, weights_only=False)
        keys = [k for c in sorted(k for k in obj if k.startswith("model")) for k, v in obj[c].items()
                if isinstance(v, torch.Tensor)]
        opt = obj["optimizer"]
        by_index = {}
        for g, group in enumerate(opt["optimizer"]["param_groups"]):
            for j, idx in enumerate(group["params"]):
                by_index[idx] = dict(opt["optimizer"]["state"][idx], fp32_param=opt["fp32_from_fp16_params"][g][j],
                                     group=g)
        kinds = {}
        decay = [k for k in keys if "norm" not in k]
        for pos, k in enumerate(decay + [k for k in keys if "norm" in k]):
            kinds[k] = by_index[pos]
        for k, v in kinds.items():
            steps.add(float(v.pop("step")))
            out[(f.parent.name, k)] = v
        scheds.append(obj["opt_param_scheduler"])
    return out, steps, scheds


def test_optimizer_state_round_trips(tmp_path, models):
    """Llama tp2/pp2 (fused QKV, swiglu fc1) with Adam state -> common format -> Megatron: moments,
    fp32 masters, step and scheduler come back exactly; weights too."""
    model, _ = models["llama"]
    src = add_optimizer(hand_built(tmp_path / "m", model, "llama", tp=2, pp=2, iteration=40), 2, 2)
    summary = convert(src, tmp_path / "store", dst_format="interop", tp=2, pp=2)
    assert any("converted the optimizer state (exp_avg, exp_avg_sq, fp32_param), step 40" in n for n in summary.notes)
    assert any(p.name.startswith("optim-") for p in (tmp_path / "store").iterdir())
    convert(tmp_path / "store", tmp_path / "back", dst_format="megatron", tp=2, pp=2)
    assert_same_megatron(src, tmp_path / "back")
    want, want_steps, want_sched = optimizer_of(src)
    got, got_steps, got_sched = optimizer_of(tmp_path / "back")
    assert sorted(got) == sorted(want) and got_steps == want_steps == {40.0} and got_sched == want_sched
    for k in want:
        assert sorted(got[k]) == sorted(want[k]), k
        for kind in ("exp_avg", "exp_avg_sq", "fp32_param", "group"):
            x, y = got[k][kind], want[k][kind]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (k, kind)
    # resharded through another layout and back: still exact
    convert(src, tmp_path / "m14", dst_format="megatron", tp=1, pp=4)
    convert(tmp_path / "m14", tmp_path / "m22", dst_format="megatron", tp=2, pp=2)
    got, _, _ = optimizer_of(tmp_path / "m22")
    for k in want:
        assert all(torch.equal(got[k][kind], want[k][kind]) for kind in ("exp_avg", "exp_avg_sq", "fp32_param")), k


def test_optimizer_state_dropped_is_reported(tmp_path, models):
    model, hf = models["llama"]
    src = add_optimizer(hand_built(tmp_path / "m", model, "llama", tp=2, pp=2, iteration=40), 2, 2)
    summary = convert(src, tmp_path / "hf", dst_format="hf")
    assert any("optimizer state not written" in n and "Hugging Face" in n for n in summary.notes)
    assert_same_hf(hf, tmp_path / "hf")
    summary = convert(src, tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    assert not any("not written" in n for n in summary.notes)  # torch_dist carries it (test below)


def test_distrib_optim_is_reported_weights_converted(tmp_path, models):
    model, hf = models["llama"]
    src = add_optimizer(hand_built(tmp_path / "m", model, "llama", tp=2, pp=2), 2, 2, distrib=True)
    summary = convert(src, tmp_path / "hf", dst_format="hf")
    # (a real distrib_optim.pt is read: tests/formats/test_megatron_versions.py; this one is not megatron-core's layout)
    assert any("distrib_optim.pt" in n and "not megatron-core's coalesced parameter state" in n
               and "weights converted" in n for n in summary.notes)
    assert_same_hf(hf, tmp_path / "hf")


def test_torch_dist_optimizer_state_round_trips(tmp_path, models):
    """Llama tp2/pp2 Adam state (moments, fp32 masters) -> torch_dist under megatron-core's keys
    (`optimizer.state.<kind>.<weight key>`, the weight's global layout) -> common format ->
    torch_dist -> torch format: exact, with step and scheduler."""
    from interop.io.megatron_dist import DistCheckpoint

    model, _ = models["llama"]
    sched = {"max_lr": 3e-4, "num_steps": 320, "warmup_steps": 10}
    src = add_optimizer(hand_built(tmp_path / "m", model, "llama", tp=2, pp=2, iteration=40), 2, 2, scheduler=sched)
    summary = convert(src, tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    assert not any("optimizer" in n and "not" in n for n in summary.notes)
    ckpt = DistCheckpoint(tmp_path / "dist" / "iter_0000040")
    weights = [k for k in ckpt.keys() if not k.startswith("optimizer.")]
    assert sorted(k for k in ckpt.keys() if k.startswith("optimizer.")) == sorted(
        f"optimizer.state.{kind}.{k}" for kind in ("exp_avg", "exp_avg_sq", "fp32_param") for k in weights)
    for k in weights:
        assert ckpt.meta(f"optimizer.state.exp_avg.{k}")[1] == ckpt.meta(k)[1]
    # a torch_dist moment is the rank files' moments merged the way the weight is (fc1: [gate; up] globally)
    want, want_steps, want_sched = optimizer_of(src)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    halves = [want[(f"mp_rank_0{t}_000", fc1)]["exp_avg"].chunk(2) for t in range(2)]
    assert torch.equal(ckpt.read("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight", 1),
                       torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]]))
    opt = ckpt.common["optimizer"]["optimizer"]  # mixed precision: the torch state_dict wrapped, as mcore saves it
    assert float(opt["state"]["common_step"]) == 40.0 and [g["wd_mult"] for g in opt["param_groups"]] == [1.0, 0.0]
    assert ckpt.common["opt_param_scheduler"] == sched

    summary = convert(tmp_path / "dist", tmp_path / "store", dst_format="interop", tp=2, pp=2)
    assert any("converted the optimizer state (exp_avg, exp_avg_sq, fp32_param), step 40" in n for n in summary.notes)
    convert(tmp_path / "store", tmp_path / "dist2", dst_format="megatron", options={"format": "torch_dist"})
    again = DistCheckpoint(tmp_path / "dist2" / "iter_0000040")
    assert sorted(again.keys()) == sorted(ckpt.keys())
    for k in ckpt.keys():
        assert torch.equal(again.read(k), ckpt.read(k)), k
    assert again.common["optimizer"]["optimizer"]["param_groups"] == opt["param_groups"]
    convert(tmp_path / "dist2", tmp_path / "back", dst_format="megatron", tp=2, pp=2)
    assert_same_megatron(src, tmp_path / "back")
    got, got_steps, got_sched = optimizer_of(tmp_path / "back")
    assert sorted(got) == sorted(want) and got_steps == want_steps == {40.0} and got_sched == [sched] * 4
    for k in want:
        for kind in ("exp_avg", "exp_avg_sq", "fp32_param", "group"):
            x, y = got[k][kind], want[k][kind]
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (k, kind)


def test_torch_dist_other_optimizer_tensors_are_reported(tmp_path, models):
    """Optimizer tensors that are not per-weight Adam state (e.g. a distributed optimizer's buffers): weights only."""
    from interop.io.megatron_dist import DistCheckpoint, LazyTensor, write_dist_checkpoint

    model, hf = models["llama"]
    src = hand_built(tmp_path / "m", model, "llama", tp=1, pp=1, iteration=3)
    convert(src, tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    ckpt = DistCheckpoint(tmp_path / "dist" / "iter_0000003")
    tensors = [(k, LazyTensor(*ckpt.meta(k), lambda layer, k=k: ckpt.read(k, layer))) for k in ckpt.keys()]
    tensors.append(("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.exp_avg", torch.zeros(10)))
    (tmp_path / "odd").mkdir()
    write_dist_checkpoint(tmp_path / "odd" / "iter_0000003", tensors, common=ckpt.common)
    (tmp_path / "odd" / "latest_checkpointed_iteration.txt").write_text("3")
    summary = convert(tmp_path / "odd", tmp_path / "hf", dst_format="hf")
    assert any("optimizer state not converted" in n and "distributed optimizer" in n for n in summary.notes)
    assert_same_hf(hf, tmp_path / "hf")


def _mcore_optimizer(*args):
    out = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "helpers" / "mcore_optimizer.py"), *map(str, args)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_mcore_torch_dist_optimizer_state(tmp_path):
    """What megatron-core saves (FP32Optimizer over Adam, 2 steps) -> common format at tp 2 -> torch_dist,
    and -> torch format -> torch_dist: megatron-core loads both back with identical weights, Adam state
    (every moment and step) and param groups."""
    pytest.importorskip("megatron.core")
    from interop.io.megatron_dist import DistCheckpoint

    _mcore_optimizer("save", tmp_path / "mcore")
    summary = convert(tmp_path / "mcore", tmp_path / "store", dst_format="interop", tp=2)
    assert any("converted the optimizer state (exp_avg, exp_avg_sq), step 2" in n for n in summary.notes)
    convert(tmp_path / "store", tmp_path / "dist", dst_format="megatron", options={"format": "torch_dist"})
    convert(tmp_path / "mcore", tmp_path / "torch", dst_format="megatron", tp=2)
    convert(tmp_path / "torch", tmp_path / "dist2", dst_format="megatron", options={"format": "torch_dist"})
    src = DistCheckpoint(tmp_path / "mcore" / "iter_0000002")
    for out in ("dist", "dist2"):
        ckpt = DistCheckpoint(tmp_path / out / "iter_0000002")
        assert sorted(ckpt.keys()) == sorted(src.keys())
        assert all(torch.equal(ckpt.read(k), src.read(k)) for k in src.keys())
        assert ckpt.common["opt_param_scheduler"] == src.common["opt_param_scheduler"]
        result = json.loads(_mcore_optimizer("compare", tmp_path / "mcore" / "iter_0000002",
                                             tmp_path / out / "iter_0000002"))
        assert result == {"weights_equal": True, "state_equal": True, "groups_equal": True, "steps": [2.0],
                          "moments": 15}, out


def test_failed_background_write_leaves_nothing(tmp_path, models, monkeypatch):
    """Rank records are written on a helper thread during a conversion: a failure there reaches the caller
    and the half-written checkpoint is removed."""
    import errno

    from interop.io import background
    from interop.io.torch_file import TorchFileWriter
    real, calls = TorchFileWriter._write, []

    def failing(self, *args):
        calls.append(args[0])
        if len(calls) > 3:
            raise OSError(errno.EIO, "Input/output error", str(self.path))
        real(self, *args)

    monkeypatch.setattr(TorchFileWriter, "_write", failing)
    with pytest.raises(OSError, match="Input/output error"):
        convert(models["llama"][1], tmp_path / "m", dst_format="megatron", tp=2, pp=2)
    assert list(tmp_path.iterdir()) == [] and background.idle()
    monkeypatch.undo()
    convert(models["llama"][1], tmp_path / "m", dst_format="megatron", tp=2, pp=2)  # the next one is unaffected
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").is_file()


def test_row_blocks_pass_from_rank_files_to_hf(tmp_path, models, monkeypatch):
    """Megatron -> HF copies q, k, v (out of the fused QKV), gate, up and the norms file to file (copy_file_range);
    o and down (split on dim 1) and the padded vocab are read and written; the result is bit-exact."""
    from interop.io.safetensors import SafetensorsWriter
    model, hf = models["llama"]
    src = hand_built(tmp_path / "m22", model, "llama", tp=2, pp=2)
    copied, real = [], SafetensorsWriter.copy_ranges
    monkeypatch.setattr(SafetensorsWriter, "copy_ranges", lambda self, key, ranges: copied.append(key) or
                        real(self, key, ranges))
    convert(src, tmp_path / "hf", dst_format="hf")
    assert_same_hf(hf, tmp_path / "hf")
    layer = {k.split("layers.0.")[1] for k in copied if "layers.0." in k}
    assert layer == {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                     "self_attn.v_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight"}
    assert "model.embed_tokens.weight" not in copied  # 256 padded rows -> 250: read, trimmed, written
