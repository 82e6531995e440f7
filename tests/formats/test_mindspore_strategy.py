"""Our per-rank MindFormers output and strategy files are what MindSpore's own resharding expects:
`mindspore.transform_checkpoints` merges them into exactly the single-device checkpoint we write."""
import glob

import pytest
import torch

from interop.convert import convert
from interop.io.ms_ckpt import CkptFile

ms = pytest.importorskip("mindspore")


@pytest.mark.parametrize("kind,tp,pp", [("llama", 2, 2), ("gpt2", 2, 3)])
def test_transform_checkpoints_merges_our_rank_files(hf_checkpoints, tmp_path, kind, tp, pp):
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "ranks", dst_format="mindspore", tp=tp, pp=pp, options={"dialect": "mindformers"})
    convert(src, tmp_path / "single", dst_format="mindspore", tp=1, pp=1, options={"dialect": "mindformers"})
    ms.merge_pipeline_strategys(str(tmp_path / "ranks" / "strategy"), str(tmp_path / "merged_strategy.json"))
    ms.transform_checkpoints(str(tmp_path / "ranks"), str(tmp_path / "merged"), "ckpt",
                             str(tmp_path / "merged_strategy.json"), None)
    merged = ms.load_checkpoint(glob.glob(str(tmp_path / "merged" / "rank_0" / "*.ckpt"))[0])
    single = CkptFile(tmp_path / "single" / "model.ckpt")
    assert sorted(merged) == sorted(single.keys())
    for key in single.keys():
        want = single.read(key)
        got = torch.from_numpy(merged[key].asnumpy())
        assert got.shape == want.shape and torch.equal(got, want), key


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_reads_transform_checkpoints_output_directly(hf_checkpoints, tmp_path, kind):
    """mindspore.transform_checkpoints' own rank_N folders (tp2/pp2 -> tp2/pp1 and -> one rank), read with
    only --model-config: tp and pp come from the files, no interop sidecar."""
    import json
    from safetensors.torch import load_file
    src = hf_checkpoints[kind]
    convert(src, tmp_path / "ranks", dst_format="mindspore", tp=2, pp=2, options={"dialect": "mindformers"})
    convert(src, tmp_path / "tp2", dst_format="mindspore", tp=2, pp=1, options={"dialect": "mindformers"})
    ms.merge_pipeline_strategys(str(tmp_path / "ranks" / "strategy"), str(tmp_path / "merged_strategy.json"))
    targets = {"resharded": str(tmp_path / "tp2" / "strategy" / "strategy_stage0.json"), "merged": None}
    for name, dst_strategy in targets.items():
        ms.transform_checkpoints(str(tmp_path / "ranks"), str(tmp_path / name), "ckpt",
                                 str(tmp_path / "merged_strategy.json"), dst_strategy)
        assert not (tmp_path / name / "mindspore_model.json").exists()
        convert(tmp_path / name, tmp_path / f"{name}-hf", dst_format="hf",
                options={"model_config": str(src / "config.json")})
        x, y = load_file(src / "model.safetensors"), load_file(tmp_path / f"{name}-hf" / "model.safetensors")
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x), name
    assert len(list((tmp_path / "resharded").glob("rank_*"))) == 2
    desc = json.loads((tmp_path / "tp2" / "mindspore_model.json").read_text())
    assert desc["layout"]["tp"] == 2
