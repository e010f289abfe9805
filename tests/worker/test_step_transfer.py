"""One copy per step: a step's tensors packed into one buffer, moved once, rebuilt as views.

Real metadata from `input_batch` for a step of decodes, a chunk longer than the ring, a later chunk,
a paged group, a ring group and a compressed group; the round trip keeps every tensor and the
structure, every tensor comes back as a view of one storage, and a step on another device costs
one `Tensor.to` (the "meta" device stands in for CUDA: no data, same code path)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.model_executor.layers.attention.backend import AttentionMetadata, CompressedGroupMetadata, move_step
from deepinfer.model_executor.layers.attention.transfer import pack, transfer, unpack
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.input_batch import StepInputs, build_step_inputs, group_addressing

CPU = torch.device("cpu")
BLOCK, WINDOW, RING, RATIO = 4, 4, 8, 2
GROUPS = [CacheGroupSpec("full", "paged", (0,), BLOCK), CacheGroupSpec("swa", "ring", (1,), RING, WINDOW),
          CacheGroupSpec("csa", "paged", (2,), BLOCK, None, compress_ratio=RATIO)]


def _request(i: int, start: int, n: int, sample: bool = True) -> ScheduledRequest:
    blocks = list(range(10 * i, 10 * i + -(-(start + n) // BLOCK)))
    return ScheduledRequest(f"r{i}", [100 + i] * n, start, (blocks, blocks[::-1]), (i,),
                            sampling_params=SamplingParams() if sample else None)


def _plan() -> StepPlan:
    """Two decodes, a first chunk of 11 tokens (longer than the ring: store_rows is set) and a
    later chunk that does not sample yet."""
    return StepPlan([_request(0, 0, 11), _request(1, 9, 1), _request(2, 5, 3, sample=False), _request(3, 17, 1)])


def _step() -> StepInputs:
    return build_step_inputs(_plan(), group_addressing(GROUPS), CPU)


def _assert_same(a, b, path="step") -> None:
    """Same structure (types, lists, ints), equal tensors (dtype, shape, values)."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


def test_the_step_has_every_kind_of_field():
    md = _step().attn_metadata
    full, ring, csa = md.groups
    assert md.num_decode_tokens == 2 and len(full.prefills) == 2 and full.decode_index is not None
    assert ring.store_rows is not None  # the 11-token chunk stores only its last RING rows
    assert isinstance(csa, CompressedGroupMetadata) and csa.decode_rows is not None and len(csa.span_rows) == 4


def test_round_trip_keeps_every_tensor_and_the_structure():
    inputs = _step()
    md, (ids, index) = move_step(inputs.attn_metadata, [inputs.input_ids, inputs.sample_index], CPU, force=True)
    _assert_same(md, inputs.attn_metadata)
    _assert_same([ids, index], [inputs.input_ids, inputs.sample_index])
    assert md.spans is inputs.attn_metadata.spans  # plain data is shared, not rebuilt


def test_round_trip_tensors_are_views_of_one_storage():
    inputs = _step()
    before = _storages([inputs.input_ids, inputs.sample_index, *inputs.attn_metadata.tensors()])
    md, extra = move_step(inputs.attn_metadata, [inputs.input_ids, inputs.sample_index], CPU, force=True)
    assert len(before) > 10  # built as separate tensors
    assert len(_storages([*extra, *md.tensors()])) == 1


def test_pack_true_on_the_cpu_gives_one_storage_and_the_same_step():
    plain = _step()
    packed = build_step_inputs(_plan(), group_addressing(GROUPS), CPU, pack=True)
    _assert_same(packed.attn_metadata, plain.attn_metadata)
    _assert_same([packed.input_ids, packed.positions, packed.sample_index],
                 [plain.input_ids, plain.positions, plain.sample_index])
    assert packed.positions is packed.attn_metadata.positions
    assert len(_storages([packed.input_ids, packed.sample_index, *packed.attn_metadata.tensors()])) == 1


def _count_device_copies(monkeypatch) -> list:
    calls = []
    real = torch.Tensor.to

    def counting(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if out.device != self.device:
            calls.append(out.device)
        return out

    monkeypatch.setattr(torch.Tensor, "to", counting)
    return calls


def test_a_step_for_another_device_is_one_copy(monkeypatch):
    calls = _count_device_copies(monkeypatch)
    inputs = build_step_inputs(_plan(), group_addressing(GROUPS), torch.device("meta"))
    assert calls == [torch.device("meta")]
    tensors = [inputs.input_ids, inputs.sample_index, *inputs.attn_metadata.tensors()]
    assert all(t.device.type == "meta" for t in tensors if t is not None)
    assert len({id(t._base) for t in tensors if t is not None}) == 1  # all views of the one moved buffer
    built = _step()
    assert [t.shape for t in tensors if t is not None] == \
        [t.shape for t in [built.input_ids, built.sample_index, *built.attn_metadata.tensors()] if t is not None]


def test_metadata_to_is_one_copy_and_a_no_op_where_it_already_is(monkeypatch):
    md = _step().attn_metadata
    assert md.to(CPU).groups[0].store_slots is md.groups[0].store_slots
    calls = _count_device_copies(monkeypatch)
    moved = md.to(torch.device("meta"))
    assert calls == [torch.device("meta")]
    assert isinstance(moved, AttentionMetadata) and moved.positions.device.type == "meta"
    assert [t.shape for t in moved.tensors() if t is not None] == [t.shape for t in md.tensors() if t is not None]
    calls.clear()
    segment = md.groups[0].prefills[1].to(torch.device("meta"))
    assert calls == [torch.device("meta")] and segment.load_slots.device.type == "meta"


def test_pack_keeps_absent_fields_and_empty_tensors():
    tensors = [torch.arange(6).view(2, 3), None, torch.empty(0, dtype=torch.long), torch.tensor([7, 8])]
    packed = pack(tensors)
    assert packed.buffer.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    out = unpack(packed, packed.buffer)
    assert out[1] is None and out[2].shape == (0,)
    _assert_same(out, tensors)
    assert all(a is b for a, b in zip(transfer(tensors, CPU), tensors, strict=True))  # already there: as they are


def test_pack_refuses_another_dtype():
    with pytest.raises(TypeError, match="int64"):
        pack([torch.arange(3), torch.zeros(2, dtype=torch.int32)])
