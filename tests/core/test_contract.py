"""The format contract (`interop.contract`), the engine over it (`interop.engine`), tensor keys and training state.

A format that writes only the required methods converts through the engine: every optional
capability's default does nothing, so the engine never needs to ask what a reader or writer has."""
from __future__ import annotations

import pickle

import pytest
import torch

from interop.contract import BaseReader, BaseWriter
from interop.engine import Task, fused_plan, split_units, stream
from interop.layout import ParallelLayout
from interop.params import TensorKey, base_param_name, param_index, param_table
from interop.spec import ModelSpec
from interop.state import TrainingState
from interop.tensors import Source, TensorMeta

SPEC = ModelSpec(arch="llama", num_layers=2, hidden=64, ffn_hidden=96, heads=8, kv_groups=2, head_dim=8,
                 vocab=250, padded_vocab=250, max_positions=64, norm="rmsnorm", norm_eps=1e-5,
                 activation="swiglu", position="rope", tied_embeddings=False)


class MinimalReader(BaseReader):
    """Only what is required: `source`, `metas`, `read`."""

    def __init__(self, tensors: dict):
        self.tensors, self.source = tensors, Source(SPEC, state={"iteration": 7})

    def metas(self):
        return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def read(self, name):
        return self.tensors[name]


class MinimalWriter(BaseWriter):
    """Only what is required: `padded_vocab`, `write`, `finish_units`, `finish_global`."""

    padded_vocab = staticmethod(lambda spec, tp: 256)

    def __init__(self):
        self.got, self.finished = {}, None

    def write(self, name, tensor):
        self.got[name] = tensor.clone()

    def finish_units(self, state=None):
        return {"tensors": len(self.got)}

    def finish_global(self, state, results):
        self.finished = (state, results)


def _tensors(with_moments: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {p.name: torch.randn(p.shape, generator=gen) for p in param_table(SPEC)}
    if with_moments:
        out.update({str(TensorKey(p.name, "exp_avg")): torch.randn(p.shape, generator=gen) for p in param_table(SPEC)})
    return out


def test_a_format_with_only_the_required_methods_converts():
    tensors = _tensors(with_moments=True)
    reader, writer = MinimalReader(tensors), MinimalWriter()
    out_spec = SPEC.replace(padded_vocab=MinimalWriter.padded_vocab(SPEC, 2))
    metas_in = reader.metas()
    index = param_index(out_spec)
    metas_out = [TensorMeta(m.name, m.dtype, index[base_param_name(m.name)].shape) for m in metas_in]
    assert fused_plan(reader, writer, metas_in, metas_out) == {}  # neither side offers a fused row
    notes: list[str] = []
    count, nbytes = stream(reader, writer, metas_in, metas_out, index, SPEC.vocab, "src", notes)
    assert count == len(tensors) and nbytes == sum(m.nbytes for m in metas_out)
    embed = writer.got["embed.word.weight"]
    assert embed.shape[0] == 256 and torch.equal(embed[:250], tensors["embed.word.weight"]) and not embed[250:].any()
    assert torch.equal(writer.got["optim.exp_avg.layers.1.mlp.down.weight"],
                       tensors["optim.exp_avg.layers.1.mlp.down.weight"])
    reader.confirm()
    assert writer.carry(reader.carried) is False and not reader.carried  # nothing carried, nothing kept
    writer.finish(reader.source.state)
    assert writer.finished == ({"iteration": 7}, {"tensors": len(tensors)})
    assert list(writer.notes) == [] and writer.units == () and not writer.splits and not writer.holds_moe
    assert reader.native_name("embed.word.weight") is None and reader.byte_ranges("embed.word.weight") is None
    writer.abort()
    reader.close()


def test_a_required_method_left_out_is_refused_at_once():
    class NoRead(BaseReader):
        def metas(self):
            return []

    with pytest.raises(TypeError, match="read"):
        NoRead()


def test_the_task_travels_to_a_process_and_opens_its_part():
    layout = ParallelLayout.build(SPEC.num_layers, 1, 1, 1, None, None, 1, None)
    task = Task("src", MinimalReader, MinimalWriter, {}, {}, "dst", SPEC, layout, (), (), SPEC.vocab)
    part = pickle.loads(pickle.dumps(task.for_part(1, frozenset({"b"}))))
    assert (part.part, part.only, part.reader_cls) == (1, frozenset({"b"}), MinimalReader)
    with pytest.raises(AttributeError):
        part.only = None  # frozen
    assert split_units(list("abcde"), 2) == [frozenset("ab"), frozenset("cde")]


def test_tensor_keys():
    key = TensorKey.parse("optim.exp_avg_sq.layers.0.attn.q.weight")
    assert (key.param, key.kind, key.is_optim, key.is_master) == ("layers.0.attn.q.weight", "exp_avg_sq", True, False)
    assert str(key) == "optim.exp_avg_sq.layers.0.attn.q.weight" and str(key.of("lm_head.weight")) == \
        "optim.exp_avg_sq.lm_head.weight"
    assert TensorKey.parse("optim.fp32_param.norm.weight").is_master
    weight = TensorKey.parse("layers.0.attn.q.weight")
    assert (weight.kind, weight.is_optim, weight.prefix, str(weight)) == (None, False, "", "layers.0.attn.q.weight")
    assert TensorKey.parse("optim.unknown.x").param == "optim.unknown.x"  # not a kind: a name as it is


def test_training_state_reads_neutral_fields_and_keeps_extensions_apart():
    state = TrainingState.of({"iteration": 3, "consumed_samples": True, "scheduler": {"lr": 1e-3},
                              "tokenizer_model": "/x/tok.model", "megatron": {"args": {}}, "other": 1})
    assert (state.iteration, state.consumed_samples, state.scheduler, state.tokenizer_model) == \
        (3, None, {"lr": 1e-3}, "/x/tok.model")
    assert state.extensions == {"megatron": {"args": {}}} and TrainingState.of(None) == TrainingState()
