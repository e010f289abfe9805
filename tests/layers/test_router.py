"""The one MoE router (layers/router.py): each family's options against the formula it stands for."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model_executor.layers.router import Router, RouterSpec

T, H, E, K = 9, 8, 8, 2


def _router(**options) -> Router:
    router = Router(RouterSpec(H, E, K, **options))
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(1)))
    return router


def _x() -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(2))


def test_softmax_topk_renormalized_is_a_softmax_over_the_topk_logits():
    ids, weights = _router(renormalize=True)(_x())  # [T, k]
    logits = F.linear(_x(), _router().weight)  # [T, E]
    torch.testing.assert_close(weights, logits.gather(1, ids).softmax(-1))
    assert torch.equal(ids, logits.topk(K, dim=-1).indices)


def test_topk_before_score_takes_the_softmax_over_the_k_logits_with_the_bias():
    router = _router(topk_before_score=True, linear_bias=True, fp32_logits=False)
    with torch.no_grad():
        router.bias.copy_(torch.arange(E, dtype=torch.float32))
    ids, weights = router(_x())
    top, want = F.linear(_x(), router.weight, router.bias).topk(K, dim=-1)
    assert torch.equal(ids, want) and torch.equal(weights, top.softmax(-1))


def test_group_limit_routes_only_to_the_best_groups():
    router = _router(score="sigmoid", correction_bias=True, num_groups=4, topk_group=1, scale=2.0)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 5.0]))
    ids, weights = router(_x())
    assert set(ids.flatten().tolist()) == {6, 7}  # group 3 wins on the bias; the weights stay unbiased
    scores = torch.sigmoid(F.linear(_x(), router.weight))
    torch.testing.assert_close(weights, scores.gather(1, ids) * 2.0)


def test_hash_router_reads_its_table_and_needs_the_token_ids():
    router = _router(score="sqrtsoftplus", hash_vocab=16, renormalize=True)
    table = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:K] for i in range(16)])
    with torch.no_grad():
        router.tid2eid.copy_(table)
    input_ids = torch.arange(T) % 16
    ids, weights = router(_x(), input_ids)
    assert torch.equal(ids, table[input_ids])
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))
    with pytest.raises(ValueError, match="input_ids is required"):
        router(_x())


def test_keep_fp32_survives_a_cast_and_unknown_scores_are_named():
    assert _router(keep_fp32=True).to(torch.bfloat16).weight.dtype == torch.float32
    assert _router().to(torch.bfloat16).weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scoring_func must be one of"):
        RouterSpec(H, E, K, score="relu")
