"""DeepSeek-V4 hyper-connections and MoE against HF transformers' modules; quantized-weight decoding.

HF modules get random weights, their state dicts load into ours by name (models/utils.py
`load_weights`), and outputs are compared in fp32. Dequantization tests build FP8 / FP4 bytes by
hand from known values, so the expected results are exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.deepseek_v4.hyper_connection import (
    HyperConnection,
    HyperHead,
    expand_streams,
    sinkhorn_normalize,
)
from deepinfer.model_executor.models.deepseek_v4.moe import DeepseekV4MoE
from deepinfer.model_executor.models.deepseek_v4.weights import (
    FP4_E2M1_VALUES,
    dequantize_fp4,
    dequantize_fp8,
    dequantize_v4_weights,
    unpack_fp4,
)
from deepinfer.model_executor.models.utils import load_weights

T, H, VOCAB = 11, 64, 97
ATOL = 1e-5


def tiny_config(hc_mult: int = 4, **overrides) -> DeepseekV4Config:
    kwargs = dict(hidden_size=H, num_hidden_layers=2, vocab_size=VOCAB, n_routed_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=32, hc_mult=hc_mult, hc_sinkhorn_iters=20, num_attention_heads=2,
                  head_dim=32, q_lora_rank=16, o_lora_rank=16, o_groups=1, index_n_heads=2, index_head_dim=16,
                  sliding_window=8, mlp_layer_types=["hash_moe", "moe"],
                  layer_types=["sliding_attention", "sliding_attention"], swiglu_limit=0.75)
    return DeepseekV4Config(**{**kwargs, **overrides})


def randomize(module: nn.Module, std: float = 0.3) -> nn.Module:
    """Fill every floating parameter/buffer with N(0, std) (scales around 1)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * std)
                if name.endswith("scale"):
                    t.add_(1.0)
    return module


def load_from(ours: nn.Module, theirs: nn.Module) -> nn.Module:
    loaded = load_weights(ours, theirs.state_dict().items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    return ours


# ----------------------------------------------------------------------------- hyper-connections

@pytest.mark.parametrize("hc_mult", [2, 4])
def test_hyper_connection_matches_hf(hc_mult):
    cfg = tiny_config(hc_mult)
    theirs = randomize(hf.DeepseekV4HyperConnection(cfg), std=0.5)
    ours = load_from(HyperConnection.from_config(cfg), theirs)
    streams = torch.randn(1, T, hc_mult, H)
    post_ref, comb_ref, x_ref = theirs(streams)
    x, post, comb = ours(streams[0])
    torch.testing.assert_close(x, x_ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(post, post_ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(comb, comb_ref[0], atol=ATOL, rtol=0)
    assert not torch.allclose(comb, comb.transpose(-1, -2))  # the merge direction is tested


@pytest.mark.parametrize("hc_mult", [2, 4])
def test_hyper_head_matches_hf(hc_mult):
    cfg = tiny_config(hc_mult)
    theirs = randomize(hf.DeepseekV4HyperHead(cfg), std=0.5)
    ours = load_from(HyperHead.from_config(cfg), theirs)
    streams = torch.randn(1, T, hc_mult, H)
    torch.testing.assert_close(ours(streams[0]), theirs(streams)[0], atol=ATOL, rtol=0)


def test_sinkhorn_is_doubly_stochastic():
    comb = torch.rand(5, 4, 4) * 3 + 0.01
    out = sinkhorn_normalize(comb, num_iters=50, eps=0.0)
    torch.testing.assert_close(out.sum(-1), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)


class _StubAttention(nn.Module):
    """Stands in for attention: a linear map, returning HF's (output, weights) pair."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False)

    def forward(self, x, **kwargs):
        return self.proj(x), None


def _ours_layer(cfg, theirs: hf.DeepseekV4DecoderLayer) -> nn.ModuleDict:
    ours = nn.ModuleDict({
        "self_attn": _StubAttention(), "mlp": DeepseekV4MoE(cfg, 0),
        "input_layernorm": RMSNorm(H, cfg.rms_norm_eps), "post_attention_layernorm": RMSNorm(H, cfg.rms_norm_eps),
        "attn_hc": HyperConnection.from_config(cfg), "ffn_hc": HyperConnection.from_config(cfg),
    })
    return load_from(ours, theirs)


def test_decoder_layer_stream_plumbing_matches_hf():
    """HF's decoder layer (attention stubbed) vs hc -> norm -> block -> merge, twice."""
    cfg = tiny_config(4)
    theirs = hf.DeepseekV4DecoderLayer(cfg, 0)
    theirs.self_attn = _StubAttention()
    randomize(theirs)
    theirs.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(8)[:3] for _ in range(VOCAB)]))
    ours = _ours_layer(cfg, theirs)
    input_ids = torch.randint(0, VOCAB, (T,))
    embeds = torch.randn(T, H)
    ref = theirs(expand_streams(embeds, 4)[None], input_ids=input_ids[None])[0]  # [T, N, H]
    streams = expand_streams(embeds, 4)
    x, post, comb = ours["attn_hc"](streams)
    streams = HyperConnection.merge(ours["self_attn"](ours["input_layernorm"](x))[0], streams, post, comb)
    x, post, comb = ours["ffn_hc"](streams)
    streams = HyperConnection.merge(ours["mlp"](ours["post_attention_layernorm"](x), input_ids), streams, post, comb)
    torch.testing.assert_close(streams, ref, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- MoE

def _moe_pair(cfg, layer_idx: int) -> tuple[hf.DeepseekV4SparseMoeBlock, DeepseekV4MoE]:
    theirs = randomize(hf.DeepseekV4SparseMoeBlock(cfg, layer_idx))
    with torch.no_grad():
        if theirs.is_hash:
            gen = torch.Generator().manual_seed(1)
            rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[:cfg.num_experts_per_tok] for _ in range(VOCAB)]
            theirs.gate.tid2eid.copy_(torch.stack(rows))
        else:
            theirs.gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts) * 0.5)
    return theirs, load_from(DeepseekV4MoE(cfg, layer_idx), theirs)


@pytest.mark.parametrize("layer_idx, kind", [(0, "hash"), (1, "topk")])
def test_moe_matches_hf(layer_idx, kind):
    cfg = tiny_config()
    theirs, ours = _moe_pair(cfg, layer_idx)
    assert ours.is_hash == (kind == "hash")
    x, input_ids = torch.randn(T, H), torch.randint(0, VOCAB, (T,))
    ref = theirs(x[None], input_ids=input_ids[None])[0]
    torch.testing.assert_close(ours(x, input_ids), ref, atol=ATOL, rtol=0)
    _, ref_w, ref_ids = theirs.gate(x, input_ids) if ours.is_hash else theirs.gate(x)
    ids, weights = ours.route(x, input_ids)
    torch.testing.assert_close(ids.sort(-1).values, ref_ids.sort(-1).values)
    pre_act = torch.einsum("th,eih->tei", x, ours.experts.gate_up_proj)
    assert pre_act.abs().max() > cfg.swiglu_limit  # the clamp is exercised


def test_topk_bias_steers_choice_not_weights():
    cfg = tiny_config()
    _, ours = _moe_pair(cfg, 1)
    x = torch.randn(T, H)
    with torch.no_grad():
        ours.gate.e_score_correction_bias.copy_(torch.tensor([100.0, 100.0, 100.0] + [0.0] * 5))
    ids, weights = ours.route(x, None)
    assert (ids.sort(-1).values == torch.tensor([0, 1, 2])).all()
    scores = ours.gate.scores(x)[:, :3]
    expected = scores / scores.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), expected, atol=1e-6, rtol=0)


def test_score_routed_block_of_a_hash_layer_routes_by_score():
    """The MTP block's MoE (`score_routed`) at index 0, a hash layer of the model: it routes as HF's
    score-routed layer 1 does, with no token ids and no `tid2eid`."""
    cfg = tiny_config()
    theirs = randomize(hf.DeepseekV4SparseMoeBlock(cfg, 1))
    ours = load_from(DeepseekV4MoE(cfg, 0, score_routed=True), theirs)
    assert not ours.is_hash and "gate.tid2eid" not in dict(ours.named_parameters())
    x = torch.randn(T, H)
    torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=ATOL, rtol=0)


def test_hash_layer_requires_input_ids():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="input_ids"):
        DeepseekV4MoE(cfg, 0)(torch.randn(T, H))


def test_experts_dense_reference_and_empty_batch():
    experts = randomize(FusedExperts(num_experts=6, hidden_size=H, intermediate_size=16, swiglu_limit=None))
    gen = torch.Generator().manual_seed(7)  # inputs independent of which tests ran before
    x, ids = torch.randn(T, H, generator=gen), torch.randint(0, 6, (T, 2), generator=gen)
    weights = torch.rand(T, 2, generator=gen)
    expected = torch.zeros(T, H)
    for t in range(T):
        for j in range(2):
            gate, up = (experts.gate_up_proj[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (experts.down_proj[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    # Outputs reach ~30, where one fp32 ulp is 1.9e-6: the fused path sums in another order, so the
    # bound is a few ulps of the value (rtol) on top of ATOL, not ATOL alone.
    torch.testing.assert_close(experts(x, ids, weights), expected, atol=ATOL, rtol=4 * torch.finfo(torch.float32).eps)
    assert experts(x[:0], ids[:0], weights[:0]).shape == (0, H)
    with pytest.raises(ValueError, match="topk_ids"):
        experts(x, ids + 6, weights)


def test_load_expert_weight_matches_stacks():
    src = randomize(FusedExperts(num_experts=3, hidden_size=H, intermediate_size=16, swiglu_limit=None))
    dst = FusedExperts(num_experts=3, hidden_size=H, intermediate_size=16, swiglu_limit=None)
    for e in range(3):
        gate, up = src.gate_up_proj[e].chunk(2)
        dst.load_expert_weight(e, "w1", gate)
        dst.load_expert_weight(e, "up_proj", up)
        dst.load_expert_weight(e, "w2", src.down_proj[e])
    assert torch.equal(dst.gate_up_proj, src.gate_up_proj) and torch.equal(dst.down_proj, src.down_proj)
    with pytest.raises(ValueError, match="proj must be one of"):
        dst.load_expert_weight(0, "w4", gate)
    with pytest.raises(ValueError, match="has shape"):
        dst.load_expert_weight(0, "w2", gate)


# ----------------------------------------------------------------------------- dequantization

def e4m3_byte(sign: int, exp: int, mant: int) -> tuple[int, float]:
    """An e4m3 byte built by hand and its value (normal numbers, exp in 1..15)."""
    return (sign << 7) | (exp << 3) | mant, (-1) ** sign * 2.0 ** (exp - 7) * (1 + mant / 8)


def e2m1_code(value: float) -> int:
    return FP4_E2M1_VALUES.index(value) if value != 0 or str(value)[0] != "-" else 8


def pack_fp4(values: list[list[float]]) -> torch.Tensor:
    codes = torch.tensor([[e2m1_code(v) for v in row] for row in values], dtype=torch.uint8)  # [R, C]
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)  # [R, C/2]


def e8m0(exponents: list[list[int]]) -> torch.Tensor:
    """UE8M0 scales 2**e, as float8_e8m0fnu built from bytes e + 127."""
    return (torch.tensor(exponents) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_unpack_fp4_nibble_order():
    packed = torch.tensor([[0xF1, 0x53]], dtype=torch.uint8).view(torch.int8)  # codes 1, 15 | 3, 5
    assert unpack_fp4(packed).tolist() == [[0.5, -6.0, 1.5, 3.0]]


def test_dequantize_fp4_group_scales():
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 16, (3, 64), generator=gen)
    values = [[FP4_E2M1_VALUES[i] for i in row] for row in idx.tolist()]
    exps = [[0, 1], [-2, 3], [5, -7]]
    out = dequantize_fp4(pack_fp4(values), e8m0(exps))
    expected = torch.tensor(values) * torch.tensor(exps, dtype=torch.float32).exp2().repeat_interleave(32, dim=1)
    assert torch.equal(out, expected)


def test_dequantize_fp8_partial_blocks():
    gen = torch.Generator().manual_seed(4)
    rows, cols = 130, 200  # grid 2 x 2 with partial edge blocks
    sign, exp, mant = (torch.randint(lo, hi, (rows, cols), generator=gen) for lo, hi in [(0, 2), (1, 16), (0, 8)])
    exp = exp.clamp(max=15)
    mant = torch.where(exp == 15, mant.clamp(max=6), mant)  # e4m3 has no inf; S.1111.111 is NaN
    byte = (sign << 7) | (exp << 3) | mant
    value = (1 - 2 * sign.double()) * (exp.double() - 7).exp2() * (1 + mant.double() / 8)
    weight = byte.to(torch.uint8).view(torch.float8_e4m3fn)
    exps = [[0, -3], [4, 1]]
    scale_full = torch.tensor(exps, dtype=torch.float64).exp2()
    scale_full = scale_full.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    assert e4m3_byte(0, 7, 4) == (0x3C, 1.5)
    assert torch.equal(dequantize_fp8(weight, e8m0(exps)).double(), value * scale_full)
    raw = (torch.tensor(exps) + 127).to(torch.uint8)  # scales as raw exponent bytes
    assert torch.equal(dequantize_fp8(weight, raw).double(), value * scale_full)


def _fp8_pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    byte, val = e4m3_byte(1, 8, 2)  # -2.5
    weight = torch.full((4, 8), byte, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return weight, e8m0([[2]]), torch.full((4, 8), val * 4)


def test_dequantize_v4_weights_names_and_passthrough():
    w8, s8, v8 = _fp8_pair()
    w4 = pack_fp4([[1.0, -0.5] * 16] * 2)  # [2, 16] packed, 32 values per row
    stacked = torch.stack([w4, w4])  # [E=2, 2, 16]
    tid2eid = torch.tensor([[1, 0]], dtype=torch.uint8)
    named = [
        ("layers.0.attn.wq_a.scale", s8), ("layers.0.attn.wq_a.weight", w8),  # DeepSeek names
        ("layers.0.ffn.experts.0.w1.weight", w4), ("layers.0.ffn.experts.0.w1.scale", e8m0([[1], [-1]])),
        ("model.layers.0.self_attn.q_a_proj.weight", w8), ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", s8),
        ("model.layers.0.mlp.experts.gate_up_proj_scale_inv", e8m0([[[0]] * 2] * 2)),
        ("model.layers.0.mlp.experts.gate_up_proj", stacked),
        ("model.layers.0.attn_hc.scale", torch.ones(3)), ("layers.0.hc_attn_scale", torch.ones(3)),
        ("layers.0.ffn.gate.tid2eid", tid2eid), ("embed.weight", torch.ones(5, 4, dtype=torch.bfloat16)),
    ]
    out = dict(dequantize_v4_weights(named, dtype=torch.float32))
    assert sorted(out) == sorted(["layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight",
                                  "model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.mlp.experts.gate_up_proj",
                                  "model.layers.0.attn_hc.scale", "layers.0.hc_attn_scale",
                                  "layers.0.ffn.gate.tid2eid", "embed.weight"])
    assert torch.equal(out["layers.0.attn.wq_a.weight"], v8)
    assert torch.equal(out["model.layers.0.self_attn.q_a_proj.weight"], v8)
    assert out["layers.0.ffn.experts.0.w1.weight"].tolist() == [[2.0, -1.0] * 16, [0.5, -0.25] * 16]
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"], torch.tensor([[[1.0, -0.5] * 16] * 2] * 2))
    assert out["layers.0.ffn.gate.tid2eid"] is tid2eid and out["embed.weight"].dtype == torch.bfloat16
    assert next(dequantize_v4_weights([("a.weight", w8), ("a.scale", s8)]))[1].dtype == torch.bfloat16


def test_dequantize_v4_weights_errors():
    w8, s8, _ = _fp8_pair()
    with pytest.raises(ValueError, match="'a.weight' has no scale"):
        list(dequantize_v4_weights([("a.weight", w8)]))
    with pytest.raises(ValueError, match="'a.weight_scale_inv' has no quantized weight"):
        list(dequantize_v4_weights([("a.weight_scale_inv", s8)]))
    with pytest.raises(ValueError, match="scale of 'a.weight' has shape"):
        list(dequantize_v4_weights([("a.weight", w8), ("a.scale", e8m0([[0, 0]]))]))
