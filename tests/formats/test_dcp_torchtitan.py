"""`--dcp-layout torchtitan` / `--from dcp` on torchtitan's step-N layout.

A real torchtitan 0.3.0 save is read in `test_torchtitans_own_save_reads_as_its_hf_export` and
`test_torchtitans_optimizer_state_is_read` (tests/fixtures/torchtitan, written by its CheckpointManager on CPU:
scripts/make_torchtitan_fixture.py, PROVENANCE).  The other tests take the layout from its source, cited:
components/checkpointer/dcp.py `_flattened_model_states_sd` (the model's state dict at the
top level of the DCP folder, beside optimizer / lr_scheduler / dataloader / train_state), models/llama3/
state_dict_adapter.py (0.3.0: `attention.qkv_linear.wq/wk/wv`, `feed_forward.w1/w3/w2`, `attention_norm`,
`ffn_norm`, `norm`, `lm_head`; q and k `_reverse_permute`d from HF: view(heads, 2, head_dim // 2, dim)
.transpose(1, 2)).  The source model is the FSDP2 fixture (tests/fixtures/fsdp_dcp, GQA, vocab 250).
"""
from pathlib import Path

import torch
from click.testing import CliRunner

from interop.cli.main import main
from interop.converters import dcp
from interop.formats import detect_format

FIXTURE = Path(__file__).parents[1] / "fixtures" / "fsdp_dcp"
HEADS, KV_HEADS, HIDDEN = 4, 2, 32


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def reverse_permute(w, heads):  # torchtitan's HF -> torchtitan, as its adapter writes it
    return w.view(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def test_torchtitan_layout_written_and_read_back(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    step = tmp_path / "step-2"
    code, out = run("convert", FIXTURE, step, "--to", "dcp", "--dcp-layout", "torchtitan")
    assert code == 0, out
    dcp_to_torch_save(str(step), str(tmp_path / "titan.pt"))  # torch's own reading of what we wrote
    titan = torch.load(tmp_path / "titan.pt")
    dcp_to_torch_save(str(FIXTURE / "pytorch_model_fsdp_0"), str(tmp_path / "hf.pt"))
    hf = torch.load(tmp_path / "hf.pt")["model"]
    assert set(titan) == {"tok_embeddings.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{k}.weight" for i in range(2) for k in (
            "attention_norm", "ffn_norm", "attention.qkv_linear.wq", "attention.qkv_linear.wk",
            "attention.qkv_linear.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    for i in range(2):
        p = f"model.layers.{i}."
        assert torch.equal(titan[f"layers.{i}.attention.qkv_linear.wq.weight"],
                           reverse_permute(hf[p + "self_attn.q_proj.weight"], HEADS))
        assert torch.equal(titan[f"layers.{i}.attention.qkv_linear.wk.weight"],
                           reverse_permute(hf[p + "self_attn.k_proj.weight"], KV_HEADS))
        assert torch.equal(titan[f"layers.{i}.feed_forward.w1.weight"], hf[p + "mlp.gate_proj.weight"])
        assert torch.equal(titan[f"layers.{i}.feed_forward.w2.weight"], hf[p + "mlp.down_proj.weight"])
    assert torch.equal(titan["lm_head.weight"], hf["lm_head.weight"])

    # back: detected as torchtitan's, and HF out of it is the source exactly
    assert detect_format(step) == "dcp"
    reader = dcp.Reader(step)
    assert "torchtitan-0.3 layout" in reader.source.notes
    code, out = run("convert", step, tmp_path / "hf", "--to", "hf")
    assert code == 0, out
    from transformers import AutoModelForCausalLM
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(got[k], hf[k]) for k in got)


def test_torchtitan_02_spelling_is_read(tmp_path):
    """torchtitan 0.1-0.2 names (attention.wq, output): the same tensors under older names."""
    import torch.distributed.checkpoint as tdcp
    step = tmp_path / "step-2"
    code, out = run("convert", FIXTURE, step, "--to", "dcp", "--dcp-layout", "torchtitan")
    assert code == 0, out
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(step), str(tmp_path / "t.pt"))
    new = torch.load(tmp_path / "t.pt")
    old = {k.replace("qkv_linear.", "").replace("lm_head.", "output."): v for k, v in new.items()}
    tdcp.save(old, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    code, out = run("convert", tmp_path / "old", tmp_path / "hf", "--to", "hf", "--model-config", FIXTURE / "config.json")
    assert code == 0, out
    a, b = dcp.Reader(step), dcp.Reader(tmp_path / "old", model_config=FIXTURE / "config.json")
    for m in a.metas():
        assert torch.equal(a.read(m.name), b.read(m.name))


def test_torchtitans_own_save_reads_as_its_hf_export(tmp_path):
    """torchtitan 0.3.0's CheckpointManager save (step-2/: its names at the top level beside the flattened
    optimizer, lr_scheduler, train_state) to HF: bit-identical to torchtitan's own Llama3StateDictAdapter.to_hf
    export, loaded by transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    real = Path(__file__).parents[1] / "fixtures" / "torchtitan"
    assert detect_format(real / "step-2") == "dcp"
    code, out = run("convert", real / "step-2", tmp_path / "hf", "--to", "hf", "--model-config", real / "config.json")
    assert code == 0, out
    assert "torchtitan-0.3 layout" in out and "converted torchtitan's optimizer state" in out
    expected = load_file(real / "expected_hf.safetensors")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(got) == set(expected) and len(got) == 21
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_torchtitans_optimizer_state_is_read():
    """Its AdamW state flattened per parameter; 0.3 trains q, k, v as one `qkv_linear.wqkv`: the moments read
    for q, k, v, put back in torchtitan's layout (its interleaved-rope permutation, then its
    `_merge_qkv_on_load`: per KV head [q heads; k; v]), are the stored fused moments."""
    from interop.io.megatron_dist import DcpCheckpoint
    real = Path(__file__).parents[1] / "fixtures" / "torchtitan"
    reader = dcp.Reader(real / "step-2", model_config=real / "config.json")
    assert reader.source.state["optimizer"] == {"type": "adamw", "step": 2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                "weight_decay": 0.01, "lr": 0.01 * 8 / 9}  # LambdaLR, step 2 of 10
    weights = [m for m in reader.metas() if not m.name.startswith("optim.")]
    assert len(weights) == 21 and len(reader.metas()) == 4 * 21
    stored = DcpCheckpoint(real / "step-2")
    heads, kv, hd = 4, 2, 8
    for i in range(2):
        q, k, v = (reader.read(f"optim.exp_avg.layers.{i}.attn.{p}.weight") for p in "qkv")
        q, k = reverse_permute(q, heads), reverse_permute(k, kv)
        merged = torch.cat([q.reshape(kv, heads // kv, hd, -1), k.reshape(kv, 1, hd, -1), v.reshape(kv, 1, hd, -1)],
                           dim=1).reshape(-1, q.shape[1])
        assert torch.equal(merged, stored.read(f"optimizer.state.layers.{i}.attention.qkv_linear.wqkv.weight.exp_avg"))
        assert torch.equal(reader.read(f"optim.exp_avg_sq.layers.{i}.mlp.down.weight"),
                           stored.read(f"optimizer.state.layers.{i}.feed_forward.w2.weight.exp_avg_sq"))
