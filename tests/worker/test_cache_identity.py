"""The cache identity covers every choice that changes a row's bits (seed 004: no reuse after the
weights change): quantization (its mode and each weight's format), the kernels' ISA, the compute
dtype, ... gathered in one `NumericsRecord` hashed as a whole; and a start-up canary catches what
the record misses: a few fixed rows whose bits must match the directory's record of the identity,
or the engine takes a root of its own."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types

import pytest
import torch
from test_kv_restart import KW, generate, prompts_for, tiny_v4_dir, tokens

from deepinfer import LLM
from deepinfer.contracts import kv_files
from deepinfer.contracts.numerics import DERIVED, NumericsRecord
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa
from deepinfer.worker.cache_canary import canary_digest
from deepinfer.worker.prefix_store import cache_identity

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "deepseek_v4"))


def identity_of(path: str, **kw) -> str:
    with LLM(path, **KW, **kw) as llm:
        return llm.engine.runner.cache_identity


def test_int8_rows_are_never_served_to_none(tiny_checkpoint, tmp_path):
    """The same files and directory, quantization int8 then none: different identities, and the
    second engine computes its own rows (the tokens of a run without the directory)."""
    path, cache_dir = tiny_checkpoint("llama"), str(tmp_path / "kv")
    prompts = prompts_for(49152, seed=41)
    ref = tokens(generate(LLM(path, quantization="none", enable_prefix_caching=False, **KW), prompts))
    with LLM(path, quantization="int8", kv_cache_dir=cache_dir, **KW) as llm:
        generate(llm, prompts)
        int8_identity = llm.engine.runner.cache_identity
    with LLM(path, quantization="none", kv_cache_dir=cache_dir, **KW) as llm:
        outs = generate(llm, prompts)
        assert llm.engine.runner.cache_identity != int8_identity
        assert outs[0].num_cached_tokens == 0 and llm.get_metrics()["prefix_cache_disk_hits"] == 0
    assert tokens(outs) == ref


@pytest.mark.slow
def test_identical_settings_share_the_identity_and_the_rows(tiny_checkpoint, tmp_path, caplog):
    path, cache_dir = tiny_checkpoint("llama"), str(tmp_path / "kv")
    prompts = prompts_for(49152, seed=42)
    with LLM(path, quantization="int8", kv_cache_dir=cache_dir, **KW) as llm:
        ref = tokens(generate(llm, prompts))
        first = llm.engine.runner.cache_identity
    caplog.set_level(logging.WARNING)
    with LLM(path, quantization="int8", kv_cache_dir=cache_dir, **KW) as llm:
        outs = generate(llm, prompts)
        assert llm.engine.runner.cache_identity == first
        assert outs[0].num_cached_tokens >= 64 and tokens(outs) == ref
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "the canary agrees with its record"


@pytest.mark.slow
def test_isa_cap_changes_the_identity(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    default = identity_of(path, quantization="int8")
    assert kernel_isa() != 0, "the CPU kernels are built (make .venv/.installed)"
    monkeypatch.setenv("DEEPINFER_CPU_ISA", "none")
    kernel_isa.cache_clear()
    try:
        capped = identity_of(path, quantization="int8")
    finally:
        monkeypatch.undo()
        kernel_isa.cache_clear()
    assert capped != default
    assert identity_of(path, quantization="int8") == default


@pytest.mark.real_model
def test_gguf_kept_packed_and_dequantized_differ(default_gguf_path):
    """The default model's GGUF tensors kept packed (Q4_1 ...) or dequantized, in one dtype."""
    with LLM(default_gguf_path, max_model_len=64, quantization="gguf", dtype="float32") as packed, \
            LLM(default_gguf_path, max_model_len=64, quantization="none", dtype="float32") as plain:
        a, b = packed.engine.runner, plain.engine.runner
        assert a.cache_identity != b.cache_identity
        assert a.numerics.tensor_types != b.numerics.tensor_types
        assert set(a.numerics.weight_formats) - {"float32"} and b.numerics.weight_formats == ("float32",)


def _record() -> NumericsRecord:
    return NumericsRecord(device_type="cpu", compute_dtype="float32", quantization="none", tensor_types="ab" * 16,
                          weight_formats=("float32",), kernel_isa="avx2", attention_backend="torch",
                          kv_cache_dtype="auto", batch_invariant=False, torch_version="2.0")


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, tuple):
        return (*value, "Q4_K")
    return f"{value}-changed"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(NumericsRecord) if f.metadata != DERIVED])
def test_every_field_of_the_record_changes_the_identity(field):
    source = types.SimpleNamespace(identity="weights", hf_config=types.SimpleNamespace(model_type="llama"))
    record = _record()
    other = dataclasses.replace(record, **{field: _changed(getattr(record, field))})
    assert cache_identity(source, other, []) != cache_identity(source, record, [])
    assert cache_identity(source, dataclasses.replace(record), []) == cache_identity(source, record, [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.quantization = "int8"  # type: ignore[misc]


@pytest.mark.parametrize("field", ["kernel_set", "few_row_linear", "reasons"])
def test_derived_fields_leave_the_identity_as_it_was(field):
    """What follows from the hashed fields (the kernel set, few-row linears) or only explains them (the
    reasons: a measured dtype's timings differ run to run) is not hashed: the identity is the one the
    record had before those fields existed."""
    source = types.SimpleNamespace(identity="weights", hf_config=types.SimpleNamespace(model_type="llama"))
    record = _record()
    value = {"kernel_set": "cpu", "few_row_linear": 3, "reasons": (("dtype", "auto: measured 1.0 ms"),)}[field]
    changed = dataclasses.replace(record, **{field: value})
    assert cache_identity(source, changed, []) == cache_identity(source, record, [])
    assert record.identity() == {f: getattr(record, f) for f in (
        "device_type", "compute_dtype", "quantization", "tensor_types", "weight_formats", "kernel_isa",
        "attention_backend", "kv_cache_dtype", "batch_invariant", "torch_version")}


def test_the_runner_resolves_one_record_and_logs_it_once(tiny_checkpoint, caplog):
    """Every numerics choice, with its reason, in the one record the identity hashes, logged on one line."""
    caplog.set_level(logging.INFO, logger="deepinfer.worker")
    with LLM(tiny_checkpoint("llama"), **KW) as llm:
        runner = llm.engine.runner
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics: ")]
    assert lines == [f"numerics: {runner.numerics.describe()}"] and "\n" not in lines[0]
    record = runner.numerics
    assert record.kernel_set == runner.attention_backend.kernels.name == "cpu" and record.tensor_types
    assert {key for key, _ in record.reasons} >= {"dtype", "quantization", "batch_invariant", "attention_backend",
                                                   "kernel_set", "few_row_linear"}
    assert runner.quantization.value == record.quantization and runner.dtype_choice.value == record.compute_dtype


# ---- the canary --------------------------------------------------------------------------------------

def _record_of(cache_dir: str, identity: str) -> str:
    return open(kv_files.canary_file(cache_dir, identity)).read().strip()


@pytest.mark.slow
def test_canary_mismatch_takes_a_new_root(tiny_checkpoint, tmp_path, caplog):
    """A record that disagrees with this engine's rows (as if a setting outside the identity had
    changed them): one warning, a new root, the right tokens, and the next start-up with the same
    rows finds that root again."""
    path, cache_dir = tiny_checkpoint("llama"), str(tmp_path / "kv")
    prompts = prompts_for(49152, seed=43)
    with LLM(path, kv_cache_dir=cache_dir, **KW) as llm:
        ref = tokens(generate(llm, prompts))
        first = llm.engine.runner.cache_identity
    digest = _record_of(cache_dir, first)
    with open(kv_files.canary_file(cache_dir, first), "w") as f:
        f.write(f"{int(digest, 16) ^ 1:032x}\n")  # another engine's rows, one bit apart
    caplog.set_level(logging.WARNING)
    with LLM(path, kv_cache_dir=cache_dir, **KW) as llm:
        second = llm.engine.runner.cache_identity
        outs = generate(llm, prompts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "canary" in warnings[0], warnings
    assert second != first and second[:16] != first[:16]
    assert tokens(outs) == ref and outs[0].num_cached_tokens == 0, "the first root's rows are not used"
    assert _record_of(cache_dir, second) == digest
    with LLM(path, kv_cache_dir=cache_dir, **KW) as llm:
        assert llm.engine.runner.cache_identity == second
        again = generate(llm, prompts)
        assert tokens(again) == ref and again[0].num_cached_tokens >= 64  # the new root's rows


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    return tiny_v4_dir(tmp_path_factory, "v4-canary")


@pytest.mark.parametrize("arch", ["llama", "gemma3", "v4"])
def test_canary_is_repeatable_and_leaves_the_cache_alone(arch, tiny_checkpoint, v4_path, tmp_path):
    """The digest is the record's, the same every time, and the scratch units and per-request
    state it used hold their bytes again afterwards."""
    path, kw = (v4_path, dict(block_size=4, num_blocks=64)) if arch == "v4" else (tiny_checkpoint(arch), {})
    cache_dir = str(tmp_path / "kv")
    with LLM(path, kv_cache_dir=cache_dir, **KW, **kw) as llm:
        runner = llm.engine.runner
        for allocation in runner.caches.cache.allocations:
            allocation.view(torch.uint8).random_(0, 256)  # rows a canary must put back
        before = [a.view(torch.uint8).clone() for a in runner.caches.cache.allocations]
        state = runner.model.read_state(0)
        digest = canary_digest(runner.caches)
        assert digest == canary_digest(runner.caches) == _record_of(cache_dir, runner.cache_identity)
        allocations = runner.caches.cache.allocations
        assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(allocations, before, strict=True))
        after = runner.model.read_state(0)
        assert sorted(after) == sorted(state) and all(torch.equal(after[k], state[k]) for k in state)


@pytest.mark.multirank
@pytest.mark.slow
def test_canary_mismatch_on_one_rank_moves_both(tiny_checkpoint, tmp_path):
    """Two tensor-parallel ranks, each with its own root and record: a record that disagrees on
    rank 1 alone moves both ranks to new roots together (one all_reduce; no rank waits for
    another), the tokens stay right, and the next start-up hits the new roots."""
    path, cache_dir = tiny_checkpoint("llama"), str(tmp_path / "kv")
    prompts = prompts_for(49152, seed=44)
    kw = dict(tensor_parallel_size=2, kv_cache_dir=cache_dir, num_blocks=32)
    with LLM(path, **KW, **kw) as llm:
        ref = tokens(generate(llm, prompts))
        first = llm.engine.runner.cache_identity
    roots = [name for name in os.listdir(cache_dir) if os.path.isdir(os.path.join(cache_dir, name))]
    follower = next(name for name in roots if name != first[:16])
    record = os.path.join(cache_dir, follower, kv_files.CANARY_RECORD)
    with open(record) as f:
        digest = f.read().strip()
    with open(record, "w") as f:
        f.write(f"{int(digest, 16) ^ 1:032x}\n")
    with LLM(path, **KW, **kw) as llm:
        second = llm.engine.runner.cache_identity
        outs = generate(llm, prompts)
    assert second != first and tokens(outs) == ref and outs[0].num_cached_tokens == 0
    with LLM(path, **KW, **kw) as llm:
        again = generate(llm, prompts)
        assert llm.engine.runner.cache_identity == second
        assert tokens(again) == ref and again[0].num_cached_tokens >= 64
        assert llm.get_metrics()["prefix_cache_load_failures"] == 0, "every rank found its slices"


class _FlipOneBit:
    """`model` as the canary calls it, except that each forward ends by flipping bit 0 of the first
    byte of the first row it stored (layer 0, token 0: block 0 of the first paged group) in the
    engine's cache tensor: rows computed one bit apart, as a kernel or CPU outside the identity might."""

    def __init__(self, model, allocation: torch.Tensor, row_bytes: int):
        self.model, self.allocation, self.row_bytes = model, allocation, row_bytes

    def __call__(self, *args):
        out = self.model(*args)
        assert self.allocation[0, :self.row_bytes].any(), "the canary stored this row"
        self.allocation[0, 0] ^= 1
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_one_flipped_kv_bit_changes_the_digest_and_the_root(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    """The digest hashes the rows' bits: one flipped bit of one cached K/V row gives another digest
    (a constant digest, or one that skips the rows, fails here), and `checked_identity` (what the
    runner calls at start-up) then reads the directory's record, sees the mismatch, warns once and
    moves to a root of its own whose record holds the flipped rows' digest."""
    from deepinfer.worker.cache_canary import checked_identity

    cache_dir = str(tmp_path / "kv")
    with LLM(tiny_checkpoint("llama"), kv_cache_dir=cache_dir, **KW) as llm:
        caches, cache_config = llm.engine.runner.caches, llm.engine.config.cache
        identity, digest = caches.cache_identity, canary_digest(caches)
        assert digest == _record_of(cache_dir, identity)
        assert checked_identity(caches, identity, cache_config) == identity  # unflipped rows agree
        group = next(gi for gi, g in enumerate(caches.groups) if not g.is_ring)
        flip = _FlipOneBit(caches.model, caches.cache.allocations[group], caches.cache.codecs[group].row_bytes)
        monkeypatch.setattr(caches, "model", flip)
        flipped = canary_digest(caches)
        assert flipped != digest and flipped == canary_digest(caches)
        caplog.set_level(logging.WARNING)
        moved = checked_identity(caches, identity, cache_config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert moved != identity and len(warnings) == 1 and "canary" in warnings[0], warnings
    assert _record_of(cache_dir, identity) == digest and _record_of(cache_dir, moved) == flipped
