"""MLA's two forms on the same cached rows, and the config fields the model refuses.

The absorbed decode (q_nope folded into W_uk, MQA over the 40-wide latent rows through a kernel
set's sparse MLA hook, o folded through W_uv) must equal the unabsorbed form (every row expanded by
kv_b_proj into per-head K and V) on the same rows: plain fp32 rows and MXFP8 rows, on the torch
kernel set and on the Triton one (interpreted on the CPU).
"""

from __future__ import annotations

import pytest
import torch
from v3_tiny import randomize, tiny_config

from deepinfer.contracts.cache import PAGED, CacheGroupSpec, RowSpec
from deepinfer.distributed import parallel_state
from deepinfer.environ import Environ
from deepinfer.model_executor.layers.kernel_set import TORCH_KERNELS, TRITON_KERNELS
from deepinfer.model_executor.layers.ops.torch_sparse_mla import load_latent
from deepinfer.model_executor.models.deepseek_v3.cached_attn import CachedMLAAttention
from deepinfer.model_executor.models.deepseek_v3.config import check_config
from deepinfer.model_executor.models.deepseek_v3.mla import mla_rotary
from deepinfer.model_executor.models.deepseek_v3.model import DeepseekV3ForCausalLM
from deepinfer.worker.cache_engine import CacheEngine, RowCodec

BLOCK_ROWS, BLOCKS, NUM_ROWS, NUM_QUERIES = 4, 12, 40, 5


def attention(kv_lora_rank: int) -> CachedMLAAttention:
    cfg = tiny_config(kv_lora_rank=kv_lora_rank, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 128,
                                                               "mscale_all_dim": 0.707, "rope_theta": 10000.0})
    return randomize(CachedMLAAttention(cfg, 0, mla_rotary(cfg, 256)), seed=3).float().eval()


def layer_cache(width: int, kv_cache_dtype: str):
    """Layer 1's view of a two-layer paged group (a non-zero layer offset)."""
    row = RowSpec(1, width, shared_kv=True)
    group = CacheGroupSpec("mla", PAGED, (0, 1), BLOCK_ROWS, row=row)
    codec = RowCodec(1, width, torch.float32, kv_cache_dtype, shared_kv=True)
    return CacheEngine([group], [BLOCKS], [codec], torch.device("cpu")).group_caches(0)[1]


def index_rows(gen: torch.Generator) -> torch.Tensor:
    """[N, L] distinct slots per query (rows stored at a permutation of the slots), -1 tails of varying length."""
    slots = torch.stack([torch.randperm(NUM_ROWS, generator=gen)[:NUM_ROWS - 3] for _ in range(NUM_QUERIES)])
    count = torch.tensor([NUM_ROWS - 3, 20, 1, 9, 33])
    return slots.masked_fill(torch.arange(slots.shape[1])[None, :] >= count[:, None], -1)  # [N, L]


@pytest.mark.parametrize("kernels", [TORCH_KERNELS, TRITON_KERNELS], ids=lambda k: k.name)
@pytest.mark.parametrize(("kv_lora_rank", "kv_cache_dtype"), [(32, "auto"), (56, "fp8")])
@torch.inference_mode()
def test_absorbed_decode_equals_unabsorbed(kernels, kv_lora_rank, kv_cache_dtype):
    attn, gen = attention(kv_lora_rank), torch.Generator().manual_seed(0)
    cache = layer_cache(attn.row_dim, kv_cache_dtype)
    x = torch.randn(NUM_ROWS + NUM_QUERIES, 64, generator=gen)  # [rows + queries, hidden]
    positions = torch.randperm(200, generator=gen)[:NUM_ROWS + NUM_QUERIES]
    q_nope, q_pe, rows = attn.project(x, positions)
    cache.store(torch.arange(NUM_ROWS), rows[:NUM_ROWS, None, :], None)
    q_nope, q_pe, index = q_nope[NUM_ROWS:], q_pe[NUM_ROWS:], index_rows(gen)  # [N, H, dn], [N, H, dr], [N, L]
    got = attn.absorbed(q_nope, q_pe, cache, index, kernels, attn.no_sink)  # [N, H, dv]
    for n in range(NUM_QUERIES):
        read = load_latent(cache, index[n][index[n] >= 0])  # [L_n, D]: the same rows, as cached
        visible = torch.ones(1, read.shape[0], dtype=torch.bool)
        want = attn.unabsorbed(q_nope[n:n + 1], q_pe[n:n + 1], read, visible)  # [1, H, dv]
        torch.testing.assert_close(got[n:n + 1], want, atol=2e-5, rtol=1e-5)
    assert got.abs().max() > 0.1  # not a degenerate comparison


@pytest.mark.parametrize(("model_type", "field", "value"), [
    ("deepseek_v2", "topk_method", "noaux_tc"),
    ("deepseek_v2", "norm_topk_prob", True),
    ("deepseek_v3", "scoring_func", "softmax"),
    ("deepseek_v3", "hidden_act", "gelu"),
    ("deepseek_v3", "moe_layer_freq", 2),
    ("deepseek_v3", "n_group", 3),
])
def test_unsupported_fields_are_refused_naming_them(model_type, field, value):
    cfg = tiny_config(model_type)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r} is not supported"):
        check_config(cfg)


@pytest.mark.multirank
def test_head_split_that_does_not_divide_is_refused(monkeypatch):
    monkeypatch.setitem(parallel_state._WORLD, "rank", 0)
    monkeypatch.setitem(parallel_state._WORLD, "size", 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        DeepseekV3ForCausalLM(tiny_config(), 64)


def test_mxfp8_rows_need_a_width_of_32s():
    from deepinfer.worker.cache_sizing import plan_model_cache

    model = DeepseekV3ForCausalLM(tiny_config(), 64)  # 32 + 8 = 40 values per row
    with pytest.raises(ValueError, match=r"kv_lora_rank \+ qk_rope_head_dim=40 cannot be cached"):
        plan_model_cache(model, torch.float32, "fp8", 4, Environ(), 0)


@pytest.mark.parametrize(("kv_cache_dtype", "row_bytes"), [("bfloat16", 64 * 2), ("fp8", 64 + 64 // 32)])
def test_bytes_per_token_are_one_latent_row_per_layer(kv_cache_dtype, row_bytes):
    """kv_lora_rank 56 + 8 RoPE values: one K = V row per layer per token, 3 layers (no factor 2)."""
    from deepinfer.worker.cache_sizing import plan_model_cache

    model = DeepseekV3ForCausalLM(tiny_config(kv_lora_rank=56), 64)
    _, codecs, sizing = plan_model_cache(model, torch.float32, kv_cache_dtype, 4, Environ(), 0)
    assert codecs[0].row_bytes == row_bytes
    assert sizing.per_token == 3 * row_bytes
