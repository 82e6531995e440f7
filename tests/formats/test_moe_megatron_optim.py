"""Mixture-of-experts optimizer state in the Megatron `torch` format, against megatron-core 0.16.1 itself.

A real MoE GPTModel (qwen2moe of moe_megatron_ref: shared expert with gate, q/k/v biases) trains 2 updates at tp 1 /
ep 2 (world 2) under megatron-core's DDP and `get_megatron_optimizer`, with the plain and with the distributed
optimizer, and is saved as Megatron-LM saves `--ckpt-format torch` (see moe_optim_ref).  What megatron-core writes:

- with ep > 1 the optimizer is a ChainedOptimizer of the dense and the expert optimizer (optimizer/__init__.py
  `get_megatron_optimizer`; experts are `allreduce=False` only when ep > 1: tensor_parallel/layers.py), so the rank
  file's `optimizer` is a list of two state dicts, each numbering its own parameters;
- `distrib_optim.pt` is a list too (ChainedOptimizer.save_parameter_state): the dense buffers on data-parallel rank 0
  only (EP rank 0's folder; None in the others), the experts' buffers laid out over the expert-data-parallel group.

interop converts these to ep 1, tp 2 and ep 2, and fresh megatron-core models at those layouts load them as
Megatron-LM's `load_checkpoint` does and train the same two updates.
"""
import json

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

import helpers.moe_optim_ref as O  # noqa: E402
from interop.convert import convert  # noqa: E402
from interop.errors import InteropError  # noqa: E402

# label -> (tp, ep): the layouts interop writes and megatron-core resumes at (world 2: dp = 2 / tp)
TARGETS = {"ep1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}
OPTIMIZERS = ("plain", "distopt")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-optim")
    O.save(root / "mcore")
    jobs, summaries = [], {}
    for opt in OPTIMIZERS:
        distributed = opt == "distopt"
        for label, (tp, ep) in TARGETS.items():
            extra = dict(distributed_optimizer=True, dp=2 // tp) if distributed else {}
            out = root / f"{opt}-{label}"
            summaries[(opt, label)] = convert(root / "mcore" / opt, out, dst_format="megatron", tp=tp, ep=ep, **extra)
            jobs.append(dict(label=f"{opt}-{label}", folder=str(out / "iter_0000002"), tp=tp, ep=ep,
                             distributed=distributed))
        # tp 2 and back to ep 2: the moments survive the expert tensor-parallel split exactly
        back = root / f"{opt}-back"
        convert(root / f"{opt}-tp2", back, dst_format="megatron", tp=1, ep=2,
                **(dict(distributed_optimizer=True, dp=2) if distributed else {}))
        jobs.append(dict(label=f"{opt}-back", folder=str(back / "iter_0000002"), tp=1, ep=2, distributed=distributed))
    results = O.resume(jobs, root / "jobs.json")
    return root, summaries, results


def test_megatron_cores_moe_save_is_a_chained_optimizer(run):
    root, _, _ = run
    it = root / "mcore" / "plain" / "iter_0000002"
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        saved = torch.load(it / folder / "model_optim_rng.pt", weights_only=False)["optimizer"]
        assert isinstance(saved, list) and len(saved) == 2
        assert [g["is_expert_parallel"] for g in saved[1]["param_groups"]] == [True]
        assert all(not g["is_expert_parallel"] for g in saved[0]["param_groups"])
    it = root / "mcore" / "distopt" / "iter_0000002"
    first = torch.load(it / "mp_rank_00_000" / "distrib_optim.pt", weights_only=False)
    other = torch.load(it / "mp_rank_00_001" / "distrib_optim.pt", weights_only=False)
    assert isinstance(first, list) and first[0] is not None and first[1] is not None
    assert other[0] is None and other[1]["buckets_coalesced"] is True


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_moe_optimizer_state_is_read_and_written(run, opt):
    _, summaries, _ = run
    for label in TARGETS:
        notes = summaries[(opt, label)].notes
        assert any(n.startswith("converted the optimizer state") and "dense and expert optimizers" in n
                   for n in notes), notes
        assert not any("optimizer state not" in n or "not written" in n for n in notes), notes


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_ep2_output_equals_megatron_cores_own_files(run, opt):
    """Written back at the source's layout, the optimizer entries and distrib_optim.pt hold megatron-core's tensors
    at the same places (parameter numbering, buffer offsets)."""
    root, _, _ = run
    for folder in ("mp_rank_00_000", "mp_rank_00_001"):
        theirs = torch.load(root / "mcore" / opt / "iter_0000002" / folder / "model_optim_rng.pt", weights_only=False)
        ours = torch.load(root / f"{opt}-ep2" / "iter_0000002" / folder / "model_optim_rng.pt", weights_only=False)
        assert list(ours["model"]) == list(theirs["model"])  # module order, _extra_state slots included
        for a, b in zip(theirs["optimizer"], ours["optimizer"]):
            if opt == "plain":
                assert a["state"].keys() == b["state"].keys()
                assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
                for i, state in a["state"].items():
                    for k in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(state[k], b["state"][i][k]), (folder, i, k)
            groups = (lambda x: x["optimizer"]["param_groups"]) if opt == "distopt" else (lambda x: x["param_groups"])
            strip = lambda gs: [{k: v for k, v in g.items() if k not in ("params", "betas")} for g in gs]  # noqa: E731
            assert strip(groups(a)) == strip(groups(b))  # (betas: a list after JSON, a tuple in torch)
        if opt == "distopt":
            a = torch.load(root / "mcore" / opt / "iter_0000002" / folder / "distrib_optim.pt", weights_only=False)
            b = torch.load(root / f"{opt}-ep2" / "iter_0000002" / folder / "distrib_optim.pt", weights_only=False)
            assert len(a) == len(b) == 2 and (a[0] is None) == (b[0] is None)
            for x, y in zip(a, b):
                if x is None:
                    continue
                assert x.keys() == y.keys()
                for chunk in (k for k in x if k != "buckets_coalesced"):
                    (kx, vx), = x[chunk].items()
                    (ky, vy), = y[chunk].items()
                    assert kx == ky and vx["numel_unpadded"] == vy["numel_unpadded"]
                    for k in ("param", "exp_avg", "exp_avg_sq"):
                        assert torch.equal(vx[k], vy[k]), (folder, chunk, k)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_loaded_state_equals_the_trained_optimizers_element_for_element(run, opt):
    """megatron-core's optimizer after loading interop's ep 1 and ep 2 output holds the source run's moments (and
    fp32 masters with the distributed optimizer) for every parameter, by global name."""
    root, _, _ = run
    expected = torch.load(root / "mcore" / opt / "expected_state.pt")
    kinds = {"exp_avg", "exp_avg_sq"} | ({"fp32_param"} if opt == "distopt" else set())
    assert {k.split("/")[0] for k in expected} == kinds
    assert any(".experts.experts." in k for k in expected)  # the routed experts, by global expert number
    for label in ("ep1", "ep2", "back"):
        loaded = torch.load(root / f"{opt}-{label}" / "loaded_state.pt")
        assert loaded.keys() == expected.keys(), label
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (label, key)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_resumed_megatron_core_trains_on_as_the_source_run(run, opt):
    """The next two updates' losses (the second depends on the restored Adam state).  At tp 2 megatron-core's MoE
    layer is only exact in the forward without sequence parallelism (MoELayer refuses to train tp > 1 without it and
    the local spec's torch norms refuse it): its loss matches the source within float noise, the update afterwards
    within 1e-3; the tp 2 state converted back to ep 2 resumes exactly (test above and `back` here)."""
    root, _, results = run
    want = json.loads((root / "mcore" / opt / "expected.json").read_text())["next_losses"]
    for label in ("ep1", "ep2", "back"):
        got = results[f"{opt}-{label}"]["next_losses"]
        assert got == pytest.approx(want, abs=1e-6), (label, got, want)
    got = results[f"{opt}-tp2"]["next_losses"]
    assert abs(got[0] - want[0]) < 1e-5 and abs(got[1] - want[1]) < 1e-3, (got, want)


def test_distributed_optimizer_refuses_a_dp_without_an_expert_data_parallel_size(run, tmp_path):
    root, _, _ = run
    with pytest.raises(InteropError, match="not a multiple of ep 2"):
        convert(root / "mcore" / "distopt", tmp_path / "bad", dst_format="megatron", ep=2, distributed_optimizer=True,
                dp=1)
    assert not (tmp_path / "bad").exists()
