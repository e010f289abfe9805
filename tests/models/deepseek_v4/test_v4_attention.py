"""DeepSeek-V4 attention math against transformers' ``DeepseekV4Attention`` (fp32).

HF's sliding-layer attention gets random weights; its state dict loads into ours strictly by
name; ``forward_full`` must match HF's forward on a whole sequence longer than the window.
The sink and the row-list contract of ``sparse_attention_with_sink`` are tested on their own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.model_executor.models.deepseek_v4.attn import (
    DeepseekV4Attention,
    attention_over_parts,
    sparse_attention_with_sink,
    window_index,
)

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

HIDDEN, WINDOW = 64, 8


def tiny_config(num_layers: int = 1):
    cfg = transformers.DeepseekV4Config(
        hidden_size=HIDDEN, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, num_attention_heads=4,
        o_groups=2, o_lora_rank=16, sliding_window=WINDOW, num_hidden_layers=num_layers,
        layer_types=["sliding_attention"] * num_layers,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(cfg, seed: int = 0):
    module = hf_v4.DeepseekV4Attention(cfg, layer_idx=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module.float().eval()


@torch.no_grad()
def hf_forward(cfg, module, hidden: torch.Tensor) -> torch.Tensor:
    """HF attention standalone on one sequence: hidden [T, hidden] -> [T, hidden]."""
    x = hidden[None]  # [1, T, hidden]
    position_ids = torch.arange(hidden.shape[0])[None]  # [1, T]
    rotary = hf_v4.DeepseekV4RotaryEmbedding(cfg)
    embeddings = {label: rotary(x, position_ids, layer_type=label) for label in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=position_ids)
    out, _ = module(x, position_embeddings=embeddings, position_ids=position_ids, attention_mask=mask)
    return out[0]  # [T, hidden]


def ours_from(cfg, module) -> DeepseekV4Attention:
    ours = DeepseekV4Attention(cfg, "sliding_attention")
    ours.load_state_dict(module.state_dict(), strict=True)
    return ours.float().eval()


@pytest.mark.parametrize("num_tokens", [5, 20])
def test_forward_full_matches_hf(num_tokens):
    cfg = tiny_config()
    module = hf_attention(cfg)
    ours = ours_from(cfg, module)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))  # [T, hidden]
    expected = hf_forward(cfg, module, hidden)  # [T, hidden]
    with torch.no_grad():
        got = ours.forward_full(hidden, torch.arange(num_tokens), WINDOW)  # [T, hidden]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_window_matters():
    """A wider window changes the result past W tokens only: the window is the model's, not a no-op."""
    cfg = tiny_config()
    ours = ours_from(cfg, hf_attention(cfg))
    hidden = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(2))  # [T, hidden]
    with torch.no_grad():
        a = ours.forward_full(hidden, torch.arange(20), WINDOW)  # [T, hidden]
        b = ours.forward_full(hidden, torch.arange(20), 2 * WINDOW)  # [T, hidden]
    torch.testing.assert_close(a[:WINDOW], b[:WINDOW], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-4)


def test_rows_are_the_mask():
    """Permuting rows or padding with invalid garbage rows leaves the output unchanged."""
    gen = torch.Generator().manual_seed(3)
    q, rows = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 5, 8, generator=gen)  # [T, H, D], [T, L, D]
    sinks = torch.randn(2, generator=gen)  # [H]
    valid = torch.ones(3, 5, dtype=torch.bool)  # [T, L]
    base = sparse_attention_with_sink(q, rows, valid, sinks, 0.3)  # [T, H, D]
    perm = torch.randperm(5, generator=gen)
    torch.testing.assert_close(sparse_attention_with_sink(q, rows[:, perm], valid, sinks, 0.3), base)
    padded = torch.cat([rows, 1e3 * torch.randn(3, 4, 8, generator=gen)], dim=1)  # [T, L + 4, D]
    pad_valid = torch.cat([valid, torch.zeros(3, 4, dtype=torch.bool)], dim=1)  # [T, L + 4]
    torch.testing.assert_close(sparse_attention_with_sink(q, padded, pad_valid, sinks, 0.3), base)


def test_shared_rows_equal_rows_copied_per_query():
    """A row set shared by all queries ([L, D] + mask) and the same rows copied per query, split
    across parts in any order, give one softmax: the same output."""
    gen = torch.Generator().manual_seed(5)
    q, shared = torch.randn(4, 2, 8, generator=gen), torch.randn(6, 8, generator=gen)  # [T, H, D], [L, D]
    own = torch.randn(4, 3, 8, generator=gen)  # [T, L2, D]
    mask, own_valid = torch.rand(4, 6, generator=gen) > 0.4, torch.rand(4, 3, generator=gen) > 0.3
    sinks = torch.randn(2, generator=gen)
    parts = attention_over_parts(q, [(shared, mask), (own, own_valid)], sinks, 0.3)  # [T, H, D]
    copied = torch.cat([shared.expand(4, -1, -1), own], dim=1)  # [T, L + L2, D]
    whole = sparse_attention_with_sink(q, copied, torch.cat([mask, own_valid], dim=1), sinks, 0.3)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    swapped = attention_over_parts(q, [(own, own_valid), (shared, mask)], sinks, 0.3)
    torch.testing.assert_close(swapped, whole, rtol=1e-5, atol=1e-6)


def test_sink_limits():
    """Sink -inf: plain softmax attention. Huge sink: output -> 0. No valid row: zero, not NaN."""
    gen = torch.Generator().manual_seed(4)
    q, rows = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 6, 8, generator=gen)  # [T, H, D], [T, L, D]
    valid = torch.rand(4, 6, generator=gen) > 0.3  # [T, L]
    valid[:, 0] = True
    k = rows[:, None].expand(-1, 3, -1, -1)  # [T, H, L, D]
    ref = F.scaled_dot_product_attention(q[:, :, None], k, k, attn_mask=valid[:, None, None], scale=0.5)  # [T, H, 1, D]
    out = sparse_attention_with_sink(q, rows, valid, torch.full((3,), float("-inf")), 0.5)  # [T, H, D]
    torch.testing.assert_close(out, ref[:, :, 0], rtol=1e-5, atol=1e-6)
    huge = sparse_attention_with_sink(q, rows, valid, torch.full((3,), 1e4), 0.5)  # [T, H, D]
    assert huge.abs().max() < 1e-6
    empty = sparse_attention_with_sink(q, rows, torch.zeros_like(valid), torch.full((3,), float("-inf")), 0.5)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_window_index():
    idx = window_index(5, 3)  # [T, W]
    assert idx.tolist() == [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "compressed_sparse_attention"])
@pytest.mark.parametrize("yarn", [False, True])
def test_rope_matches_hf(layer_type, yarn):
    """Sliding layers rotate with the ``main`` RoPE, CSA/HCA layers with the ``compress`` one (YaRN too)."""
    cfg = tiny_config()
    if yarn:
        cfg = transformers.DeepseekV4Config(
            **{k: getattr(cfg, k) for k in ("hidden_size", "head_dim", "num_attention_heads", "q_lora_rank")},
            qk_rope_head_dim=16, num_hidden_layers=1, layer_types=["sliding_attention"], max_position_embeddings=1024,
            rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
        )
    label = "main" if layer_type == "sliding_attention" else "compress"
    ours = DeepseekV4Attention(cfg, layer_type)
    positions = torch.arange(0, 300, 7)  # [T]
    cos, sin = hf_v4.DeepseekV4RotaryEmbedding(cfg)(torch.zeros(1), positions[None], layer_type=label)
    x = torch.randn(1, 1, positions.shape[0], cfg.head_dim)  # [1, 1, T, D]
    expected = hf_v4.apply_rotary_pos_emb(x, cos, sin)[0, 0]  # [T, D]
    torch.testing.assert_close(ours._rope(x[0, 0], positions), expected, rtol=1e-5, atol=1e-5)


def test_decode_mla_mqa_sparse_reads_only_indexed_slots():
    """The book's decode call: two caches, one index row each; -1 and unindexed slots are never
    read (filling them with garbage changes nothing), and the result equals attention over the
    rows gathered by hand."""
    from deepinfer.contracts.cache import CacheGroupSpec
    from deepinfer.model_executor.layers.ops.torch_sparse_mla import decode_mla_mqa_sparse
    from deepinfer.worker.cache_engine import CacheEngine, RowCodec

    codec = RowCodec(1, 32, torch.float32, "auto", shared_kv=True)
    groups = [CacheGroupSpec("swa", "ring", (0,), 14, 8), CacheGroupSpec("csa", "paged", (0,), 4, compress_ratio=4)]
    engine = CacheEngine(groups, [2, 3], [codec, codec], torch.device("cpu"))
    ring, comp = engine.group_caches(0)[0], engine.group_caches(1)[0]
    gen = torch.Generator().manual_seed(6)
    ring.store(torch.arange(28), torch.randn(28, 1, 32, generator=gen), None)
    comp.store(torch.arange(12), torch.randn(12, 1, 32, generator=gen), None)
    q, sinks = torch.randn(2, 4, 32, generator=gen), torch.randn(4, generator=gen)  # [N, H, D], [H]
    win = torch.tensor([[0, 1, 2, -1], [14, 15, 16, 17]])  # [N, W]
    extra = torch.tensor([[3, 7, -1], [9, -1, -1]])  # [N, L]
    out = decode_mla_mqa_sparse(q, ring, win, 0.2, sinks, comp, extra)  # [N, H, D]
    rows = torch.cat([ring.load(win)[:, :, 0, 0], comp.load(extra)[:, :, 0, 0]], dim=1)  # [N, 7, D]
    ref = sparse_attention_with_sink(q, rows, torch.cat([win, extra], dim=1) >= 0, sinks, 0.2)
    torch.testing.assert_close(out, ref)
    unread = torch.tensor([3, 4, 5, 18, 27])  # ring slots no index names
    ring.store(unread, 1e3 * torch.randn(5, 1, 32, generator=gen), None)
    comp.store(torch.tensor([0, 11]), 1e3 * torch.randn(2, 1, 32, generator=gen), None)
    torch.testing.assert_close(decode_mla_mqa_sparse(q, ring, win, 0.2, sinks, comp, extra), out)


def test_rope_frequencies_stay_fp32_when_the_model_is_cast():
    """bf16 has 8 mantissa bits: a bf16 inv_freq would shift the angle at position 4,000 by up to
    ~16 rad. Casting the module keeps the frequencies in fp32."""
    cfg = tiny_config()
    ours = DeepseekV4Attention(cfg, "sliding_attention")
    exact = ours.inv_freq.clone()
    ours.to(torch.bfloat16)
    assert ours.inv_freq.dtype == torch.float32 and torch.equal(ours.inv_freq, exact)
