"""Checkpoints with real vocabularies (not multiples of 128), written by the real tools on the CPU.

    # Megatron-LM core_v0.16.1's training code over the project's megatron-core 0.16.1 (the checkout's
    # megatron/{training,legacy,rl,post_training} folders, e.g. `git archive core_v0.16.1 ...`):
    python scripts/make_real_vocab_fixtures.py megatron tests/fixtures/real_vocab --megatron-lm /tmp/mlm
    # MindSpeed-Core-MS r0.1.0's converter over those (its checkout's path; torch + mindspore):
    python scripts/make_real_vocab_fixtures.py mindspeed tests/fixtures/real_vocab --mindspeed-core-ms /tmp/msms
    # mbridge 0.15.1 (pip install mbridge==0.15.1 --no-deps) over megatron-core 0.16.1, gloo:
    python scripts/make_real_vocab_fixtures.py mbridge tests/fixtures/real_vocab

`megatron`: per CASE, Megatron-LM's own argument parser, tokenizer padding (`_vocab_size_with_padding`:
a NullTokenizer of `vocab` tokens -> `padded_vocab_size`), legacy GPTModel (`--use-legacy-models`, the
model MindSpeed-Core-MS r0.1.0 converts) and `save_checkpoint` (`--ckpt-format torch`) at tp ranks
spawned with gloo: `<case>/megatron/iter_0000002/mp_rank_TT/model_optim_rng.pt` + the tracker.
`mindspeed`: `convert_pt2ckpt.py --convert-param-only` over each case's iteration folder:
`<case>/mindspeed/rank_N/network.ckpt` + `pt_meta/args_tpTT_pp000.pt`.
`mbridge`: mbridge's Llama bridge builds a megatron-core model from a tiny HF Llama (`<case>/hf`, vocab
1000: mbridge does not pad) and loads its weights; `dist_checkpointing.save` of the model's sharded state
dict writes `<case>/torch_dist/iter_0000001/` as Megatron-LM's torch_dist save does.  PROVENANCE says what
ran.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ITERATION = 2
UNPADDED_VOCAB = 1000
# name: (family, true vocab, tp, tied); each a few hundred KB
CASES = {
    "llama_v250_tp1": ("llama", 250, 1, False),
    "llama_v1000_tp2": ("llama", 1000, 2, False),
    "llama_tied_v250_tp2": ("llama", 250, 2, True),
    "gpt2_v1000_tp1": ("gpt2", 1000, 1, True),
}
DIMS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16"]


def _megatron_argv(family: str, vocab: int, tp: int, tied: bool, save: Path) -> list[str]:
    argv = [*DIMS, "--ffn-hidden-size", "32" if family == "llama" else "64", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--tensor-model-parallel-size", str(tp), "--use-legacy-models",
            "--use-cpu-initialization", "--ckpt-format", "torch", "--save", str(save), "--no-save-optim",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--train-iters", "2",
            "--lr", "1e-4", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--transformer-impl",
            "local", "--seed", "1234", "--save-interval", "2"]
    if family == "llama":
        argv += ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type",
                 "rope", "--group-query-attention", "--num-query-groups", "2", "--no-rope-fusion"]
    if not tied:
        argv.append("--untie-embeddings-and-output-weights")
    return argv


def _megatron_worker(rank: int, world: int, port: int, megatron_lm: str, argv: list[str]) -> None:
    """One tp rank: Megatron-LM's parse_args / validate_args / set_global_variables, the legacy GPTModel,
    save_checkpoint."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    sys.path.insert(0, megatron_lm)
    from unittest import mock

    # this module needs triton (GPU kernels); nothing here calls it
    sys.modules["megatron.core.transformer.custom_layers.batch_invariant_kernels"] = mock.MagicMock()
    # the legacy LayerNorm imports apex's kernel module when built and calls it only in forward (never run here)
    sys.modules["fused_layer_norm_cuda"] = mock.MagicMock()
    sys.path.insert(0, str(Path(__file__).parent))
    from make_megatron_fixtures import _patch_cpu  # megatron-core's hard-coded CUDA calls sent to the CPU

    _patch_cpu()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # the CPU has one generator
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import mpu
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.legacy.model import GPTModel
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_global_variables

    from megatron.training import arguments

    arguments.get_device_arch_version = lambda: 10  # no GPU: no CUDA_DEVICE_MAX_CONNECTIONS advice to check
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args)
    from megatron.core.enums import ModelType

    args.model_type = ModelType.encoder_or_decoder  # what pretrain() sets for GPT
    args.apply_layernorm_1p = False  # a flag 0.16 removed and its legacy model still reads (its old default)
    set_global_variables(args)  # builds the tokenizer: args.padded_vocab_size = Megatron's padding
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    mcore_random.get_cuda_rng_tracker().add("model-parallel-rng", 1234 + rank)
    torch.manual_seed(1234)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)
    save_checkpoint(ITERATION, [model], None, None, 0)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_megatron(out: Path, megatron_lm: str) -> None:
    import torch.multiprocessing as mp

    for name, (family, vocab, tp, tied) in CASES.items():
        save = out / name / "megatron"
        argv = _megatron_argv(family, vocab, tp, tied, save)
        mp.start_processes(_megatron_worker, args=(tp, _free_port(), megatron_lm, argv), nprocs=tp,
                           start_method="spawn", join=True)
        (out / name / "megatron_argv.json").write_text(json.dumps(argv) + "\n")
        _hf_config(family, vocab, tied).save_pretrained(out / name)  # the description a user passes


def _hf_config(family: str, vocab: int, tied: bool):
    """The model's HF config (transformers' own classes), as a user converting it has one."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        rms_norm_eps=1e-5, tie_word_embeddings=tied)
    return transformers.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=2, n_head=4, n_positions=16, n_inner=64,
                                   bos_token_id=vocab - 1, eos_token_id=vocab - 1)


def make_mindspeed(out: Path, checkout: str) -> None:
    tool = Path(checkout) / "mindspeed_ms" / "tools" / "converter" / "convert_pt2ckpt.py"
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # the rank files hold an argparse Namespace
    for name, (family, vocab, tp, tied) in CASES.items():
        command = [sys.executable, str(tool), "--megatron-path", str(out / name / "megatron" / f"iter_{ITERATION:07d}"),
                   "--ms-path", str(out / name / "mindspeed"), "--tp-size", str(tp), "--pp-size", "1",
                   "--num-layers", "2", "--convert-param-only", "--multiprocess-off"]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        (out / name / "mindspeed_command.json").write_text(json.dumps(command[1:]) + "\n")


def _unpadded_worker(rank: int, world: int, port: int, out: str) -> None:
    """megatron-core's GPTModel with HF's vocabulary as it is (mbridge passes no make_vocab_size_divisible_by),
    saved by dist_checkpointing as Megatron-LM's torch_dist save does; no args (a bridge's user stores none)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(Path(__file__).parent))
    from make_megatron_fixtures import _patch_cpu

    _patch_cpu()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=32, normalization="RMSNorm", gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False, layernorm_epsilon=1e-5,
                               use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                               gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=UNPADDED_VOCAB,
                     max_sequence_length=16, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    folder = Path(out) / "torch_dist" / "iter_0000001"
    folder.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": 1, "checkpoint_version": 3.0},
                            str(folder))
    (Path(out) / "torch_dist" / "latest_checkpointed_iteration.txt").write_text("1")
    torch.distributed.destroy_process_group()


def make_unpadded(out: Path) -> None:
    import torch.multiprocessing as mp

    case = out / "llama_v1000_unpadded"
    mp.start_processes(_unpadded_worker, args=(1, _free_port(), str(case)), nprocs=1, start_method="spawn", join=True)
    _hf_config("llama", UNPADDED_VOCAB, False).save_pretrained(case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tool", choices=("megatron", "mindspeed", "unpadded"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout (its megatron/training and megatron/legacy)")
    parser.add_argument("--mindspeed-core-ms", help="a MindSpeed-Core-MS r0.1.0 checkout")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tool == "megatron":
        make_megatron(args.out, args.megatron_lm)
    elif args.tool == "mindspeed":
        make_mindspeed(args.out, args.mindspeed_core_ms)
    else:
        make_unpadded(args.out)


if __name__ == "__main__":
    main()
