"""`pt_meta/` as MindSpeed-Core-MS r0.1.0 writes and reads it (Ascend/MindSpeed-Core-MS, tag r0.1.0, not on PyPI:
the facts are encoded here from its source):

- mindspeed_ms/tools/converter/convert_pt2ckpt.py
  * __main__ / run(): `<ms-path>/pt_meta/` beside the rank folders; save_args() writes one
    `args_tp{tp:02}_pp{pp:03}.pt` per Megatron rank file (torch.save of a dict with `args`, `checkpoint_version`,
    `iteration`, `optimizer`, `opt_param_scheduler`, `rng_state`, `num_floating_point_operations_so_far`, and with
    --convert-param-only `param_name_list`); param_map*.json are copied there without --convert-param-only.
  * convert_pt2ms_param_only(): param_name_list[v] = [f"{model_key}.{flat key}" for the chunk's flattened
    Megatron model dict] reversed, model_key `model` (vpp 1) or `model{v}`, local layer numbers.
- mindspeed_ms/tools/converter/convert_ckpt2pt.py (run with --param-map-path <ms-path>/pt_meta)
  * get_ckpt(): the newest *.ckpt of `rank_{pp*dp*cp*tp_size + tp}`.
  * process_ckpt_to_pt(): int(ckpt["step_num"]); in --convert-param-only mode get_param_keys_from_pt_meta()
    = torch.load(args_tp{tp:02}_pp{pp:03}.pt)['param_name_list'][vpp] (ValueError when absent); per key:
    ms_key = key without its first component, layers renumbered by cal_corr_vpp_layers() (np.split of
    arange(num_layers) by vpp then by pp), then str.replace of each param_key_mapping entry; ckpt[ms_key].
  * reconstruct_model_optim() / add_args(): pt_args['args'] (sets .consumed_train_samples = 0; reads
    .global_batch_size), pt_args['checkpoint_version'], `'optimizer' in pt_args` -> pt_args['optimizer']
    ['optimizer']['param_groups'][i]['step'] = iteration, pt_args['opt_param_scheduler']['num_steps'] =
    iteration * args.global_batch_size, pt_args['rng_state'], pt_args['num_floating_point_operations_so_far'].
"""
import argparse

import numpy as np
import pytest
import torch

from helpers.hostile import run
from interop.convert import convert

ms = pytest.importorskip("mindspore")

PARAM_KEY_MAPPING = {"dense_h_to_4h": "mapping", "dense_4h_to_h": "projection", "self_attention": "attention",
                     "query_key_value": "qkv_proj", "dense": "out_proj"}  # convert_ckpt2pt.py param_key_mapping
L = 6


def megatron_run_source(tmp_path, src):
    """The tiny HF model in the common format with a Megatron run's state (its args, optimizer groups and
    moments, scheduler, iteration 12), as a Megatron checkpoint read by interop leaves it."""
    from interop.layout import ParallelLayout
    from interop.store import StoreReader, StoreWriter
    from interop.tensors import TensorMeta
    convert(src, tmp_path / "plain", dst_format="interop")
    reader = StoreReader(tmp_path / "plain")
    metas = reader.metas()
    moments = [TensorMeta(p + m.name, torch.float32, m.shape) for p in ("optim.exp_avg.", "optim.exp_avg_sq.")
               for m in metas]
    out = tmp_path / "megatron-run"
    out.mkdir()
    writer = StoreWriter(out, reader.spec, ParallelLayout.build(L), metas + moments)
    for m in metas + moments:
        writer.write(m.name, reader.read(m.name) if not m.name.startswith("optim.") else torch.rand(m.shape))
    writer.finish({"iteration": 12, "megatron": {
        "args": {"global_batch_size": 16, "seq_length": 32, "lr": 3e-4, "tensor_model_parallel_size": 4},
        "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 1234,
        "optimizer": {"step": 12, "param_groups": [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                    "weight_decay": 0.1}]},
        "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 64, "lr_decay_steps": 800,
                                "lr_decay_style": "cosine", "num_steps": 192, "start_wd": 0.1, "end_wd": 0.1,
                                "wd_incr_style": "constant", "wd_incr_steps": 800}}})
    return out


def emulate_convert_ckpt2pt(ms_dir, tp, pp, vpp, dp=1, cp=1):
    """What convert_ckpt2pt.py --convert-param-only reads, step by step (module docstring); returns
    {(tp, pp): {megatron key: tensor}} and the add_args() result per rank."""
    out = {}
    for p in range(pp):
        for t in range(tp):
            ckpt_dir = ms_dir / f"rank_{p * dp * cp * tp + t}"
            newest = max(ckpt_dir.glob("*ckpt"), key=lambda f: f.stat().st_mtime)
            ckpt = ms.load_checkpoint(str(newest))
            iteration = int(ckpt["step_num"].asnumpy().astype(np.float32))
            pt_args = torch.load(ms_dir / "pt_meta" / f"args_tp{t:02}_pp{p:03}.pt", map_location="cpu",
                                 weights_only=False)
            assert "param_name_list" in pt_args
            tensors = {}
            for v in range(vpp):
                vpp_layers = np.split(np.arange(L), vpp, axis=-1)[v]
                vpp_ms_layers = np.split(vpp_layers, pp, axis=-1)[p].tolist()
                for key in pt_args["param_name_list"][v]:
                    ms_key = ".".join(key.split(".")[1:])
                    if "layers" in ms_key:
                        parts = ms_key.split(".")
                        i = parts.index("layers") + 1
                        parts[i] = str(vpp_ms_layers[list(range(len(vpp_ms_layers))).index(int(parts[i]))])
                        ms_key = ".".join(parts)
                    for k, new in PARAM_KEY_MAPPING.items():
                        if k in ms_key:
                            ms_key = ms_key.replace(k, new)
                    tensors[(v, key)] = torch.tensor(ckpt[ms_key].asnumpy().astype(np.float32))
            args = pt_args["args"]
            assert isinstance(args, argparse.Namespace)
            args.consumed_train_samples = 0
            if "optimizer" in pt_args:
                for group in pt_args["optimizer"]["optimizer"]["param_groups"]:
                    group["step"] = iteration
            pt_args["opt_param_scheduler"]["num_steps"] = iteration * args.global_batch_size
            for key in ("checkpoint_version", "rng_state", "num_floating_point_operations_so_far"):
                assert key in pt_args, key
            out[(t, p)] = (tensors, pt_args, iteration)
    return out


@pytest.mark.parametrize("kind,tp,pp,vpp", [("llama", 2, 2, 1), ("gpt2", 1, 3, 1), ("llama-tied", 1, 2, 3),
                                            ("llama", 2, 3, 2)])
def test_convert_ckpt2pt_runs_on_our_pt_meta(hf_checkpoints, tmp_path, kind, tp, pp, vpp):
    """From a Megatron run's state: every key convert_ckpt2pt.py reads from pt_meta and the rank files is
    there with the right type, the run's args / optimizer groups / counters are carried (at the new layout),
    and the tensors it would rebuild equal Megatron's legacy model's (megatron_legacy_ranks, by hand)."""
    from helpers.mindspeed_legacy import megatron_legacy_ranks
    src = hf_checkpoints[kind]
    code, out = run("convert", megatron_run_source(tmp_path, src), tmp_path / "ms", "--to", "mindspore",
                    "--dialect", "mindspeed", "--tp", tp, "--pp", pp, "--vpp", vpp, "-q")
    assert code == 0, out
    assert "pt_meta/" in out and "global_batch_size" not in out
    megatron = megatron_legacy_ranks(src, kind, tp, pp, vpp)
    for (t, p), (tensors, pt_args, iteration) in emulate_convert_ckpt2pt(tmp_path / "ms", tp, pp, vpp).items():
        assert iteration == 12 and pt_args["iteration"] == 12
        for v in range(vpp):
            prefix = "model" if vpp == 1 else f"model{v}"
            chunk = megatron[(t, p)][prefix]
            assert {key for (vv, key) in tensors if vv == v} == {f"{prefix}.{k}" for k in chunk}, (t, p, v)
            for key, value in chunk.items():
                assert torch.equal(tensors[(v, f"{prefix}.{key}")], value.float()), key
        args = pt_args["args"]
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
        assert args.num_layers == L and args.global_batch_size == 16 and args.seq_length == 32
        assert args.use_legacy_models is True
        assert pt_args["opt_param_scheduler"]["num_steps"] == 12 * 16
        assert pt_args["opt_param_scheduler"]["lr_decay_style"] == "cosine"
        groups = pt_args["optimizer"]["optimizer"]["param_groups"]
        assert groups[0]["lr"] == pytest.approx(3e-4) and groups[0]["step"] == 12
        assert pt_args["num_floating_point_operations_so_far"] == 1234 and pt_args["checkpoint_version"] == 3.0


@pytest.mark.parametrize("kind,tp,pp,vpp", [("llama", 2, 2, 1), ("gpt2", 2, 3, 1), ("llama-tied", 1, 2, 3)])
def test_param_name_list_names_megatron_legacy_keys(hf_checkpoints, tmp_path, kind, tp, pp, vpp):
    """From HF (no Megatron run): param_name_list holds, per chunk and reversed, exactly the keys of Megatron's
    legacy GPT model dict (test_mindspore_mindspeed.megatron_legacy_ranks, written out by hand), and each of
    them resolves to a rank-file tensor equal to the Megatron tensor."""
    from helpers.mindspeed_legacy import megatron_legacy_ranks
    src = hf_checkpoints[kind]
    summary = convert(src, tmp_path / "ms", dst_format="mindspore", tp=tp, pp=pp, vpp=vpp,
                      options={"dialect": "mindspeed"})
    assert any("global_batch_size" in n for n in summary.notes)  # HF names no batch size: said, not invented
    assert any("no optimizer" in n for n in summary.notes)
    megatron = megatron_legacy_ranks(src, kind, tp, pp, vpp)
    for (t, p), chunks in megatron.items():
        pt_args = torch.load(tmp_path / "ms" / "pt_meta" / f"args_tp{t:02}_pp{p:03}.pt", weights_only=False)
        assert "optimizer" not in pt_args  # add_args() skips it; None there would stop the tool
        assert pt_args["rng_state"] is None and isinstance(pt_args["opt_param_scheduler"], dict)
        assert pt_args["checkpoint_version"] == 3.0 and pt_args["iteration"] == 0
        names = pt_args["param_name_list"]
        assert len(names) == vpp
        for v in range(vpp):
            prefix = "model" if vpp == 1 else f"model{v}"
            expected = [f"{prefix}.{k}" for k in chunks[prefix]]
            assert names[v] == expected[::-1], (t, p, v)
    for path in (tmp_path / "ms" / "pt_meta").glob("args_*.pt"):
        pt_args = torch.load(path, weights_only=False)
        pt_args["args"].global_batch_size = 8  # the user's step the note asks for; then the tool runs through
        torch.save(pt_args, path)
    for (t, p), (tensors, _, _) in emulate_convert_ckpt2pt(tmp_path / "ms", tp, pp, vpp).items():
        for (v, key), value in tensors.items():
            prefix = "model" if vpp == 1 else f"model{v}"
            assert torch.equal(value, megatron[(t, p)][prefix][key[len(prefix) + 1:]].float()), key


def test_reader_takes_pt_meta(hf_checkpoints, tmp_path):
    """--from mindspore with pt_meta: the layout is checked against it (a mismatch is one error line) and its
    Megatron args reach the training state."""
    src = hf_checkpoints["llama"]
    convert(megatron_run_source(tmp_path, src), tmp_path / "ms", dst_format="mindspore", tp=2, pp=2, options={"dialect": "mindspeed"})
    (tmp_path / "ms" / "mindspore_model.json").unlink()
    summary = convert(tmp_path / "ms", tmp_path / "common", dst_format="interop",
                      options={"model_config": str(src / "config.json")})
    assert any("as pt_meta/ says" in n for n in summary.notes)
    import json
    state = json.loads((tmp_path / "common" / "interop.json").read_text())["state"]
    assert state["megatron"]["args"]["num_layers"] == L and state["megatron"]["args"]["global_batch_size"] == 16
    (tmp_path / "ms" / "pt_meta" / "args_tp01_pp001.pt").rename(tmp_path / "ms" / "pt_meta" / "args_tp02_pp001.pt")
    code, out = run("convert", tmp_path / "ms", tmp_path / "bad", "--to", "hf", "--model-config",
                    src / "config.json", "-q")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "pt_meta" in out, out
    assert not (tmp_path / "bad").exists()


def test_reads_the_real_tools_pt_meta(hf_checkpoints, tmp_path):
    """convert_pt2ckpt.py's own pt_meta (save_args of a Megatron rank file: its args Namespace with a torch
    dtype, `optimizer` None under --convert-param-only of a weights-only file, an rng_state list, and the copied
    param_map json of a run without --convert-param-only) is read safely: layout checked, args kept."""
    from helpers.mindspeed_legacy import PT_EXTRA, megatron_legacy_ranks, run_convert_pt2ckpt
    src = hf_checkpoints["llama"]
    run_convert_pt2ckpt(megatron_legacy_ranks(src, "llama", 2, 2), tmp_path / "ms", L, 2, 2, pt_extra=PT_EXTRA)
    for p in range(2):
        for t in range(2):
            args = argparse.Namespace(num_layers=L, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      params_dtype=torch.bfloat16, global_batch_size=8, seq_length=32)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 40, "optimizer": None,
                        "opt_param_scheduler": PT_EXTRA["opt_param_scheduler"], "rng_state": [{"random_rng_state": 1}],
                        "num_floating_point_operations_so_far": 77,
                        "param_name_list": [["model.language_model.embedding.word_embeddings.weight"]]},
                       tmp_path / "ms" / "pt_meta" / f"args_tp{t:02}_pp{p:03}.pt")
    (tmp_path / "ms" / "pt_meta" / "param_map_buffer0_dp0tp0pp0vpp0.json").write_text("{}")
    summary = convert(tmp_path / "ms", tmp_path / "common", dst_format="interop",
                      options={"model_config": str(src / "config.json")})
    assert any("as pt_meta/ says" in n for n in summary.notes)
    import json
    meg = json.loads((tmp_path / "common" / "interop.json").read_text())["state"]["megatron"]
    assert meg["args"]["global_batch_size"] == 8 and meg["args"]["params_dtype"] == "bfloat16"
    assert meg["num_floating_point_operations_so_far"] == 77
