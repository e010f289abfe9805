"""The few-row variant (`ops/few_rows.py`): measured once per process among the SIMD variants this
CPU runs, or named by DEEPINFER_QDOT_FEW_ROW_ISA; whichever runs, a row's bits are the same."""

from __future__ import annotations

import logging

import pytest
import torch
from test_qdot import activations, random_blocks

from deepinfer.model_executor.layers.ops import few_rows
from deepinfer.model_executor.layers.ops import qdot as qd
from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_level, qdot_levels


@pytest.fixture
def fresh_choice(monkeypatch):
    few_rows.few_row_level.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    few_rows.few_row_level.cache_clear()


def test_the_measured_choice_is_a_simd_variant_and_said_once(fresh_choice, caplog):
    fresh_choice.delenv("DEEPINFER_QDOT_FEW_ROW_ISA", raising=False)
    default = qdot_level()
    simd = [level for level in qdot_levels() if 2 <= level <= default]
    with caplog.at_level(logging.INFO, logger="deepinfer.kernels"):
        choice = few_rows.few_row_level(default)
        assert few_rows.few_row_level(default) == choice  # measured once
    said = [r.getMessage() for r in caplog.records if "few-row integer dot products" in r.getMessage()]
    if len(simd) < 2:  # one SIMD variant (or none): nothing to measure
        assert choice == default and not said
    else:
        assert choice in simd and len(said) == 1 and all(few_rows._NAMES[v] in said[0] for v in simd), said


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_named_few_row_variant_gives_the_same_bits(fresh_choice, kind):
    if 2 not in qdot_levels():
        pytest.fail("the CPU test machines all run AVX2")
    fresh_choice.setenv("DEEPINFER_QDOT_FEW_ROW_ISA", "avx2")
    assert few_rows.few_row_level(qdot_level()) == 2
    w = random_blocks(kind, 40, 512, seed=5)
    for m in (1, 3, 8, 12):  # 12 rows (two levels of 6): the many-row path, the widest variant
        x = activations(m, 512, seed=m)
        ref = qd.qdot_ref(qd.quantize_acts_ref(x, 2), w)
        assert torch.equal(qd.qlinear(x, w, levels=2), ref), (kind, m)
        assert torch.equal(qd.qlinear(x, w, levels=1), qd.qdot_ref(qd.quantize_acts_ref(x, 1), w)), (kind, m)


def test_a_bad_variant_name_is_refused_by_name(fresh_choice):
    fresh_choice.setenv("DEEPINFER_QDOT_FEW_ROW_ISA", "sse9")
    with pytest.raises(ValueError, match="DEEPINFER_QDOT_FEW_ROW_ISA must name a variant .*'sse9'"):
        few_rows.few_row_level(qdot_level())
