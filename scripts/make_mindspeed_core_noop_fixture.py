"""MindSpeed-Core-MS r0.1.0's reverse converter run over interop's uneven-pipeline MindSpeed output.

    git -C <MindSpeed-Core-MS checkout> archive r0.1.0 mindspeed_ms/tools/converter | tar -x -C /tmp/msms
    python scripts/make_mindspeed_core_noop_fixture.py tests/fixtures/mindspeed_core_noop --mindspeed-core-ms /tmp/msms

Per case, a sandwich-norm model (the PanGu 38B's facts at a tiny width: GQA 4 / 2, vocab 250, scales 0.0447 /
0.0825) in the common format (`<case>/common/`), converted by interop to `--dialect mindspeed` at tp 2, then
`convert_ckpt2pt.py --convert-param-only` with the flags interop's note gives writes `<case>/megatron/` (Megatron
legacy rank files, bfloat16 as that tool casts):
- `last_short`: 5 layers over the stages 2,2,1 (the guide's 16,16,16,14 in small: only the last stage shorter),
  `--num-layers 6 --noop 5`;
- `noop_2_7`: 6 layers at pp 2 written with `--noop-layers 2,7` (positions 0,1,3 | 4,5,6), `--num-layers 8 --noop 2 7`.  The MindSpore files are not kept: interop's writer rebuilds them
(tests/formats/test_mindspeed_core_noop.py checks they still name what the tool read).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from interop.convert import convert
from interop.layout import ParallelLayout
from interop.params import param_table
from interop.spec import ModelSpec
from interop.store import StoreWriter
from interop.tensors import TensorMeta

SPEC = dict(arch="llama", num_layers=6, hidden=16, ffn_hidden=32, heads=4, kv_groups=2, head_dim=4, vocab=250,
            padded_vocab=256, max_positions=64, norm="rmsnorm", norm_eps=1e-5, activation="swiglu", position="rope",
            tied_embeddings=False, pre_norm=True, post_norm=True, attn_post_norm_scale=0.0447,
            mlp_post_norm_scale=0.0825)
# case: (layers, interop's split and options, the tool's flags)
CASES = {
    "last_short": (5, dict(tp=2, pp=3, first_stage_layers=2, last_stage_layers=1),
                   ["--num-layers", "6", "--noop", "5", "--pp-size", "3"]),
    "noop_2_7": (6, dict(tp=2, pp=2, noop_layers="2,7"), ["--num-layers", "8", "--noop", "2", "7", "--pp-size", "2"]),
}


def write_common(dst: Path, layers: int) -> None:
    dst.mkdir(parents=True)
    spec = ModelSpec(**{**SPEC, "num_layers": layers})
    gen = torch.Generator().manual_seed(3)
    table = param_table(spec)
    writer = StoreWriter(dst, spec, ParallelLayout.build(spec.num_layers),
                         [TensorMeta(p.name, torch.float32, p.shape) for p in table])
    for p in table:
        noise = torch.randn(p.shape, generator=gen)
        writer.write(p.name, 1 + 0.2 * noise if "norm" in p.name else 0.05 * noise)
    writer.finish({"megatron": {"args": {"global_batch_size": 8}}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mindspeed-core-ms", required=True, help="a MindSpeed-Core-MS r0.1.0 checkout")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    for case, (layers, split, flags) in CASES.items():
        out = args.out / case
        write_common(out / "common", layers)
        with tempfile.TemporaryDirectory() as tmp:
            ms_dir = Path(tmp) / "ms"
            summary = convert(out / "common", ms_dir, dst_format="mindspore", dialect="mindspeed", **split)
            assert any(" ".join(flags[:-2]) in n for n in summary.notes), summary.notes
            tool = Path(args.mindspeed_core_ms) / "mindspeed_ms" / "tools" / "converter" / "convert_ckpt2pt.py"
            command = [sys.executable, str(tool), *flags, "--dp-size", "1", "--cp-size", "1", "--tp-size", "2",
                       "--vpp-size", "1", "--ms-path", str(ms_dir), "--convert-param-only",
                       "--param-map-path", str(ms_dir / "pt_meta"), "--megatron-path", str(out / "megatron"),
                       "--multiprocess-off"]
            env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # pt_meta holds an argparse Namespace
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        shown = ["convert_ckpt2pt.py", *command[2:]]
        for path, name in ((str(ms_dir / "pt_meta"), "<ms>/pt_meta"), (str(ms_dir), "<ms>"),
                           (str(out / "megatron"), "megatron")):
            shown = [name if c == path else c for c in shown]
        (out / "command.json").write_text(json.dumps({"interop": split, "tool": shown}) + "\n")

if __name__ == "__main__":
    main()
