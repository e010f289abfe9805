"""Pooling: the worker's pool over prefill chunks (`worker/pooling.py`) against plain torch on the
whole prompt, and the engine's reading of a checkpoint's declaration (`engine/pooling.py`)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine.pooling import NO_POOLING, UNDECLARED, pooling_config
from deepinfer.worker.pooling import Pooler

H = 8


def _chunk(rid: str, prompt: list[int], start: int, end: int, kind: str, dims=None, normalize=False):
    return ScheduledRequest(rid, prompt[start:end], start, ([],), prompt_token_ids=prompt,
                            pooling=PoolingParams(dims, normalize, pooling_type=kind))


def _pool(rows: torch.Tensor, cuts: list[int], kind: str, **kw) -> torch.Tensor:
    """Run `rows` [L, H] through a Pooler in chunks ending at `cuts`, one chunk per step."""
    pooler, prompt, start, done = Pooler(), list(range(rows.shape[0])), 0, {}
    for end in cuts:
        s = _chunk("r", prompt, start, end, kind, **kw)
        done = pooler.collect([(s, 0)], rows[start:end])
        start = end
    return torch.tensor(done["r"])


@pytest.mark.parametrize("cuts", [[37], [1, 37], [16, 32, 37], [5, 22, 23, 37], list(range(1, 38))])
def test_mean_pool_is_the_same_bits_wherever_chunks_are_cut(cuts):
    rows = torch.randn(37, H, generator=torch.Generator().manual_seed(0))
    whole = _pool(rows, [37], "mean")
    assert torch.equal(_pool(rows, cuts, "mean"), whole)
    torch.testing.assert_close(whole, rows.mean(0), rtol=1e-6, atol=1e-6)


def test_last_cls_dimensions_and_normalize_against_torch():
    rows = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_pool(rows, [7, 20], "last"), rows[-1])
    assert torch.equal(_pool(rows, [7, 20], "cls"), rows[0])
    short = _pool(rows, [7, 20], "mean", dims=3, normalize=True)
    torch.testing.assert_close(short, torch.nn.functional.normalize(rows.mean(0)[:3], dim=0))
    assert short.shape == (3,) and abs(float(short.norm()) - 1) < 1e-6


def test_a_rerun_chunk_and_a_recompute_from_zero_pool_as_once():
    """A step the engine runs again (a fault elsewhere) and a preempted request computing its prompt
    again from position 0 both give the vector of one clean pass."""
    rows = torch.randn(30, H, generator=torch.Generator().manual_seed(2))
    prompt, pooler = list(range(30)), Pooler()
    first, second = _chunk("r", prompt, 0, 20, "mean"), _chunk("r", prompt, 20, 30, "mean")
    assert pooler.collect([(first, 0)], rows[:20]) == {}
    assert pooler.collect([(first, 0)], rows[:20]) == {}  # the step again
    pooler.collect([(second, 0)], rows[20:])
    again = pooler.collect([(second, 0)], rows[20:])  # the final step again
    assert torch.equal(torch.tensor(again["r"]), _pool(rows, [30], "mean"))
    pooler.collect([(first, 0)], rows[:20])  # preempted: from position 0
    assert pooler.collect([(second, 0)], rows[20:]) == again


def test_two_requests_in_one_step_and_release():
    rows = torch.randn(12, H, generator=torch.Generator().manual_seed(3))
    a = _chunk("a", list(range(5)), 0, 5, "last")
    b = _chunk("b", list(range(9)), 0, 7, "mean")
    pooler = Pooler()
    done = pooler.collect([(a, 0), (b, 5)], rows)
    assert list(done) == ["a"] and torch.equal(torch.tensor(done["a"]), rows[4])
    pooler.release(["b"])
    with pytest.raises(RuntimeError, match="starts at position 7, but its pool holds none"):
        pooler.collect([(_chunk("b", list(range(9)), 7, 9, "mean"), 0)], rows[:2])


def _st_dir(tmp_path, modules: list[tuple[str, str]], pooling: dict | None = None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


class _Config:
    hidden_size = 64


ST = "sentence_transformers.models."


@pytest.mark.parametrize("pooling, kind", [
    ({"pooling_mode": "mean"}, "mean"), ({"pooling_mode": "lasttoken"}, "last"), ({"pooling_mode": ["cls"]}, "cls"),
    ({"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode_lasttoken": True}, "last"), ({"pooling_mode_cls_token": True}, "cls")])
def test_sentence_transformers_declarations_new_and_legacy(tmp_path, pooling, kind):
    path = _st_dir(tmp_path, [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"), (ST + "Normalize", "2")],
                   pooling)
    config = pooling_config(path, _Config())
    assert (config.pooling_type, config.normalize, config.unsupported) == (kind, True, None)
    assert "modules.json" in config.source


def test_none_declared_override_and_refused_modules(tmp_path):
    undeclared = pooling_config(str(tmp_path), _Config())
    assert (undeclared.serves, undeclared.source, undeclared.unsupported) == (False, UNDECLARED, NO_POOLING)
    with pytest.raises(ValueError, match="declares no pooling .* start it with --pooling last|mean|cls"):
        undeclared.resolve(PoolingParams())
    assert undeclared.summary() == ("embeddings, rerank and score: off (the model declares no pooling; "
                                    "--pooling last|mean|cls serves them)")
    named = pooling_config(str(tmp_path), _Config(), "last")
    assert (named.serves, named.pooling_type, named.normalize) == (True, "last", True)
    assert named.summary() == "embeddings: last pooling, L2-normalised (--pooling last: the model declares none)"
    plain = _st_dir(tmp_path / "plain", [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")],
                    {"pooling_mode": "mean"})
    assert pooling_config(plain, _Config()).normalize is False  # no Normalize module: as sentence-transformers
    assert pooling_config(plain, _Config(), "cls").pooling_type == "cls"
    dense = _st_dir(tmp_path / "dense", [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling"),
                                         (ST + "Dense", "2_Dense")], {"pooling_mode": "mean"})
    with pytest.raises(ValueError, match="Dense are not computed here"):
        pooling_config(dense, _Config(), "last").resolve(PoolingParams())
    max_pool = _st_dir(tmp_path / "max", [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")],
                       {"pooling_mode": "max"})
    with pytest.raises(ValueError, match="pooling 'max' is not computed here"):
        pooling_config(max_pool, _Config()).resolve(PoolingParams())
    assert pooling_config(max_pool, _Config(), "mean").resolve(PoolingParams()).pooling_type == "mean"


def test_gguf_pooling_type_declares_a_pooling():
    class Gguf(_Config):
        pooling_type = "mean"

    class Rank(_Config):
        pooling_type = "rank"

    declared = pooling_config(None, Gguf())
    assert (declared.serves, declared.pooling_type, declared.source) == (True, "mean", "GGUF pooling_type mean")
    with pytest.raises(ValueError, match="GGUF pooling_type 'rank' is not computed here"):
        pooling_config(None, Rank()).resolve(PoolingParams())
    assert pooling_config(None, Rank(), "cls").resolve(PoolingParams()).pooling_type == "cls"


def test_dimensions_only_where_the_config_declares_matryoshka():
    with pytest.raises(ValueError, match=r"^dimensions=16: this model does not declare Matryoshka"):
        pooling_config(None, _Config(), "last").resolve(PoolingParams(dimensions=16))

    class Matryoshka(_Config):
        pooling_type = "last"
        is_matryoshka = True

    class Listed(_Config):
        pooling_type = "last"
        matryoshka_dimensions = [16, 32]

    assert pooling_config(None, Matryoshka()).resolve(PoolingParams(dimensions=5)).dimensions == 5
    with pytest.raises(ValueError, match=r"^dimensions must be <= 64"):
        pooling_config(None, Matryoshka()).resolve(PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match=r"^dimensions must be one of \[16, 32\]"):
        pooling_config(None, Listed()).resolve(PoolingParams(dimensions=20))
    resolved = pooling_config(None, Listed()).resolve(PoolingParams(dimensions=32, normalize=False))
    assert (resolved.pooling_type, resolved.normalize, resolved.dimensions) == ("last", False, 32)


@pytest.mark.parametrize("field, value", [("dimensions", 0), ("dimensions", True), ("normalize", 1),
                                          ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
                                          ("pooling_type", "max")])
def test_pooling_params_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        PoolingParams(**{field: value})
