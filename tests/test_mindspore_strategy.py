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
