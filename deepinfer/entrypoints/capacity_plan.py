"""Capacity plan for tensor / expert parallelism, from a model's config.json alone (no weights, no model
build): per-rank weight bytes in their stored formats, KV bytes per token and per request, and the
requests that fit at a context length in what a device has left after the weights.

Splits (T = tensor_parallel_size ranks, E = expert_parallel_size):

    Llama family   q/o: heads / T            k/v: kv heads / T (1 per rank, replicated, when kv < T)
                   MLP: intermediate / T     embedding, LM head: ceil(vocab / T) rows   norms: replicated
    DeepSeek-V4    q_b / o_a / o_b / sinks: heads / T (o_groups / T groups per rank)
                   q_a, kv_proj, compressors, indexer, routers, norms, mHC: replicated
                   shared expert: intermediate / T     routed experts: n_routed_experts / E per rank
                   (each slice held by T / E ranks)    embedding, LM head: ceil(vocab / T) rows

KV of a Llama-family layer splits with its kv heads. DeepSeek-V4's latent is ONE shared row per token
(MQA, K = V) that every rank's heads read, so it is replicated on every rank, not split; so are the
index keys, the window rings and the compressor state.

Stored formats: DeepSeek-V4's `quantization_config` gives FP4 routed experts (0.5 B per value + one
UE8M0 byte per 32 values) and FP8 projections (1 B per value + one scale per 128 x 128 block);
embeddings, LM head and routers stay in `torch_dtype`, mHC, sinks and position biases in fp32.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from deepinfer.config import CacheConfig, parse_size
from deepinfer.model_executor.layers.ops.cache_common import bf16_format, get_inference_swa_block_size, mxfp8_format

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
DEFAULT_DEVICE_MEMORY = "141GB"  # one H200
_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "int64": 8}
FP4_GROUP, FP8_BLOCK = 32, 128


def load_config(path: str) -> dict:
    """config.json of a model directory (or the file itself) as a dict; a multimodal config's text part."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        cfg = json.load(f)
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def matrix_bytes(fmt: str, rows: int, cols: int, scale_bytes: int = 1) -> int:
    """Bytes of a rows x cols tensor stored in `fmt` (fp4 / fp8 with their scales, or a plain dtype)."""
    if fmt == "fp4":
        return rows * cols // 2 + rows * math.ceil(cols / FP4_GROUP)
    if fmt == "fp8":
        return rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * scale_bytes
    return rows * cols * _DTYPE_BYTES[fmt]


@dataclass(frozen=True)
class Weight:
    """`copies` tensors of rows x cols that ONE rank holds, of one part of the model, stored in `fmt`."""

    part: str
    rows: int
    cols: int
    copies: int
    fmt: str
    scale_bytes: int = 1

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.copies

    @property
    def nbytes(self) -> int:
        return self.copies * matrix_bytes(self.fmt, self.rows, self.cols, self.scale_bytes)


@dataclass(frozen=True)
class KVPart:
    """One kind of cache one rank keeps for `num_layers` layers: paged rows (one per `ratio` tokens),
    a ring of `ring_rows` rows per request, or fixed `state_bytes` per request per layer."""

    name: str
    num_layers: int
    row_bytes: int = 0
    ratio: int = 0  # tokens per paged row; 0: not paged
    ring_rows: int = 0
    state_bytes: int = 0

    @property
    def per_token(self) -> float:
        """Bytes each further token adds (all the part's layers)."""
        return self.num_layers * self.row_bytes / self.ratio if self.ratio else 0.0

    @property
    def per_request(self) -> int:
        """Fixed bytes one request holds whatever its length (rings, compressor state)."""
        return self.num_layers * (self.ring_rows * self.row_bytes + self.state_bytes)

    def bytes_at(self, num_tokens: int) -> int:
        """Bytes one request of `num_tokens` tokens holds: its fixed part plus floor(L / m) rows per layer."""
        rows = num_tokens // self.ratio if self.ratio else 0
        return self.per_request + self.num_layers * rows * self.row_bytes


@dataclass(frozen=True)
class CapacityPlan:
    """What one rank holds for a model at tensor_parallel_size T and expert_parallel_size E."""

    model_type: str
    tp: int
    ep: int
    weights: tuple[Weight, ...]
    kv: tuple[KVPart, ...]
    kv_format: str
    max_model_len: int
    device_memory: int
    gpu_memory_utilization: float
    model_weight_bytes: int = 0  # the whole model at one rank
    notes: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def part_totals(self) -> dict[str, tuple[int, int]]:
        """part -> (params, bytes) per rank, in first-seen order."""
        totals: dict[str, tuple[int, int]] = {}
        for w in self.weights:
            params, nbytes = totals.get(w.part, (0, 0))
            totals[w.part] = (params + w.params, nbytes + w.nbytes)
        return totals

    @property
    def kv_per_token(self) -> float:
        return sum(p.per_token for p in self.kv)

    @property
    def kv_per_request(self) -> int:
        return sum(p.per_request for p in self.kv)

    def request_bytes(self, num_tokens: int) -> int:
        return sum(p.bytes_at(num_tokens) for p in self.kv)

    @property
    def kv_budget(self) -> int:
        """Bytes left for the cache on one rank: the usable memory minus the rank's weights."""
        return int(self.device_memory * self.gpu_memory_utilization) - self.weight_bytes

    def requests_that_fit(self, num_tokens: int) -> int:
        return max(0, self.kv_budget) // self.request_bytes(num_tokens)


def is_v4(cfg: dict) -> bool:
    return cfg.get("model_type") == "deepseek_v4"


def check_sizes(cfg: dict, tp: int, ep: int) -> None:
    """ValueError naming the sizes when T or E cannot split this model."""
    for name, value in (("tensor_parallel_size", tp), ("expert_parallel_size", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    heads = cfg["num_attention_heads"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}")
    experts = cfg.get("n_routed_experts") or 0
    if ep > 1 and not experts:
        raise ValueError(f"expert_parallel_size={ep} but {cfg.get('model_type')} has no routed experts")
    if ep > tp or tp % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide tensor_parallel_size={tp} "
                         "(the expert-parallel ranks are the tensor-parallel ranks)")
    if experts % ep:
        raise ValueError(f"n_routed_experts={experts} is not divisible by expert_parallel_size={ep}")
    for field in _split_fields(cfg):
        if cfg[field] % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={cfg[field]}")
    kv = cfg.get("num_key_value_heads") or heads
    if not is_v4(cfg) and kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={kv}: one must divide the other")


def _split_fields(cfg: dict) -> list[str]:
    if is_v4(cfg):
        return ["o_groups", "moe_intermediate_size"]
    return ["intermediate_size"]


def head_dim_of(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def weight_dtype(cfg: dict) -> str:
    return {"float32": "fp32", "float16": "fp16"}.get(cfg.get("torch_dtype") or cfg.get("dtype"), "bf16")


def vocab_weights(cfg: dict, tp: int) -> list[Weight]:
    """Embedding and LM head, ceil(vocab / T) rows each per rank (one matrix when tied)."""
    rows, dtype = math.ceil(cfg["vocab_size"] / tp), weight_dtype(cfg)
    copies = 1 if cfg.get("tie_word_embeddings") else 2
    return [Weight("embedding + LM head", rows, cfg["hidden_size"], copies, dtype)]


def llama_weights(cfg: dict, tp: int) -> list[Weight]:
    """Llama / Qwen / Gemma 3 weights one rank holds (Megatron layout)."""
    h, d, n = cfg["hidden_size"], head_dim_of(cfg), cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"] // tp
    kv = max(1, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // tp)
    dtype, gemma = weight_dtype(cfg), cfg["model_type"].startswith("gemma3")
    inter = cfg["intermediate_size"] // tp
    out = [Weight("attention", (heads + 2 * kv) * d, h, n, dtype), Weight("attention", h, heads * d, n, dtype),
           Weight("MLP", 2 * inter, h, n, dtype), Weight("MLP", h, inter, n, dtype),
           Weight("norms", 1, h, n * (4 if gemma else 2) + 1, dtype)]
    if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
        out.append(Weight("attention", 1, (heads + 2 * kv) * d, n, dtype))
    if cfg["model_type"] == "qwen3" or gemma:
        out.append(Weight("norms", 1, d, 2 * n, dtype))
    return out + vocab_weights(cfg, tp)


def v4_formats(cfg: dict) -> tuple[str, str, int]:
    """(routed-expert format, projection format, FP8 scale bytes) from `quantization_config`."""
    qc, dtype = cfg.get("quantization_config") or {}, weight_dtype(cfg)
    proj = "fp8" if qc.get("quant_method") == "fp8" else dtype
    expert = {"fp4": "fp4", "fp8": "fp8"}.get(qc.get("expert_dtype"), proj)
    return expert, proj, 1 if qc.get("scale_fmt") == "ue8m0" else 4


def v4_attention(cfg: dict, tp: int, proj: str, sb: int) -> list[Weight]:
    """Per layer: q_a, kv_proj replicated; q_b, o_a, o_b and sinks split by heads."""
    h, d, ql, n = cfg["hidden_size"], cfg["head_dim"], cfg["q_lora_rank"], cfg["num_hidden_layers"]
    heads, groups, ol = cfg["num_attention_heads"] // tp, cfg["o_groups"] // tp, cfg["o_lora_rank"]
    per_group = cfg["num_attention_heads"] * d // cfg["o_groups"]
    norm = weight_dtype(cfg)
    return [Weight("attention", ql, h, n, proj, sb), Weight("attention", 1, ql, n, norm),
            Weight("attention", heads * d, ql, n, proj, sb), Weight("attention", d, h, n, proj, sb),
            Weight("attention", 1, d, n, norm), Weight("attention", groups * ol, per_group, n, proj, sb),
            Weight("attention", h, groups * ol, n, proj, sb), Weight("attention", 1, heads, n, "fp32")]


def v4_compressors(cfg: dict, proj: str, sb: int) -> list[Weight]:
    """CSA compressor + indexer and HCA compressor (replicated): kv/gate projections, position bias, norm."""
    h, types, norm = cfg["hidden_size"], cfg["layer_types"], weight_dtype(cfg)
    num_csa, num_hca = types.count(CSA), types.count(HCA)
    m, m_hca = cfg["compress_rates"][CSA], cfg["compress_rates"][HCA]
    out = []
    for width, ratio, overlap, count in ((cfg["head_dim"], m, 2, num_csa), (cfg["index_head_dim"], m, 2, num_csa),
                                         (cfg["head_dim"], m_hca, 1, num_hca)):
        out += [Weight("compressors + indexer", overlap * width, h, 2 * count, proj, sb),
                Weight("compressors + indexer", ratio, overlap * width, count, "fp32"),
                Weight("compressors + indexer", 1, width, count, norm)]
    index_width = cfg["index_n_heads"] * cfg["index_head_dim"]
    return out + [Weight("compressors + indexer", index_width, cfg["q_lora_rank"], num_csa, proj, sb),
                  Weight("compressors + indexer", cfg["index_n_heads"], h, num_csa, proj, sb)]


def v4_moe(cfg: dict, tp: int, ep: int, expert: str, proj: str, sb: int) -> list[Weight]:
    """Routed experts (n_routed / E per rank), shared expert (split by T), routers (replicated)."""
    h, inter, n = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    per_rank = cfg["n_routed_experts"] // ep * n
    shared = inter * cfg.get("n_shared_experts", 1) // tp
    num_hash = cfg["mlp_layer_types"].count("hash_moe")
    return [Weight("routed experts", 2 * inter, h, per_rank, expert, sb),
            Weight("routed experts", h, inter, per_rank, expert, sb),
            Weight("shared expert", 2 * shared, h, n, proj, sb), Weight("shared expert", h, shared, n, proj, sb),
            Weight("routers", cfg["n_routed_experts"], h, n, weight_dtype(cfg)),
            Weight("routers", 1, cfg["n_routed_experts"], n - num_hash, "fp32"),
            Weight("routers", cfg["vocab_size"], cfg["num_experts_per_tok"], num_hash, "int64")]


def v4_residual(cfg: dict) -> list[Weight]:
    """Norms and the mHC mixers (fp32): two per layer and the head's."""
    h, hc, n = cfg["hidden_size"], cfg["hc_mult"], cfg["num_hidden_layers"]
    mix = (2 + hc) * hc
    return [Weight("norms + mHC", 1, h, 2 * n + 1, weight_dtype(cfg)),
            Weight("norms + mHC", mix, hc * h, 2 * n, "fp32"), Weight("norms + mHC", 1, mix + 3, 2 * n, "fp32"),
            Weight("norms + mHC", hc, hc * h, 1, "fp32"), Weight("norms + mHC", 1, hc + 1, 1, "fp32")]


def v4_weights(cfg: dict, tp: int, ep: int) -> list[Weight]:
    expert, proj, sb = v4_formats(cfg)
    return [*v4_moe(cfg, tp, ep, expert, proj, sb), *v4_attention(cfg, tp, proj, sb),
            *v4_compressors(cfg, proj, sb), *v4_residual(cfg), *vocab_weights(cfg, tp)]


def row_bytes(elements: int, kv_format: str) -> int:
    """One cache row of `elements` values: MXFP8 (+1 UE8M0 byte per 32) or bf16."""
    fmt = mxfp8_format(elements) if kv_format == "fp8" else bf16_format(elements)
    return fmt.bytes_per_row


def compressor_state_bytes(ratio: int, width: int, overlap: bool) -> int:
    """fp32 state a compressor keeps per request: the open window's kv and scores [m, C] (C = 2D
    for CSA, D for HCA) and, for CSA, half A of the last window [m, D] (kv and score)."""
    prev = ratio if overlap else 0
    return 4 * (2 * ratio * (2 if overlap else 1) * width + 2 * prev * width)


def v4_kv(cfg: dict, kv_format: str) -> list[KVPart]:
    """Every layer's window ring; CSA latent + index rows (1 per m tokens) and HCA rows (1 per m'),
    with their compressor state. All replicated on every rank (one shared latent row, MQA)."""
    d, i, types = cfg["head_dim"], cfg["index_head_dim"], cfg["layer_types"]
    m, m_hca = cfg["compress_rates"][CSA], cfg["compress_rates"][HCA]
    latent, index = row_bytes(d, kv_format), row_bytes(i, kv_format)
    num_csa, num_hca = types.count(CSA), types.count(HCA)
    ring = get_inference_swa_block_size(cfg["sliding_window"])
    return [KVPart("window ring", len(types), latent, ring_rows=ring),
            KVPart("CSA latent rows", num_csa, latent, ratio=m),
            KVPart("CSA index keys", num_csa, index, ratio=m),
            KVPart("HCA latent rows", num_hca, latent, ratio=m_hca),
            KVPart("CSA compressor state", num_csa,
                   state_bytes=compressor_state_bytes(m, d, True) + compressor_state_bytes(m, i, True)),
            KVPart("HCA compressor state", num_hca, state_bytes=compressor_state_bytes(m_hca, d, False))]


def llama_kv(cfg: dict, tp: int, kv_format: str) -> list[KVPart]:
    """K and V of the rank's kv heads: paged for full layers, a ring of S rows for sliding layers."""
    n, d = cfg["num_hidden_layers"], head_dim_of(cfg)
    heads = cfg["num_attention_heads"]
    kv = max(1, cfg.get("num_key_value_heads", heads) // tp)
    row = row_bytes(2 * kv * d, kv_format)
    types = cfg.get("layer_types") or ["full_attention"] * n
    window = cfg.get("sliding_window")
    num_sliding = types.count(SLIDING) if window else 0
    parts = [KVPart("full-attention K|V rows", n - num_sliding, row, ratio=1)] if n > num_sliding else []
    if num_sliding:
        parts.append(KVPart("sliding-window ring", num_sliding, row, ring_rows=get_inference_swa_block_size(window)))
    return parts


def plan_capacity(cfg: dict, tp: int = 1, ep: int = 1, max_model_len: int | None = None,
                  device_memory: int | str = DEFAULT_DEVICE_MEMORY,
                  gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                  kv_cache_dtype: str = CacheConfig.kv_cache_dtype) -> CapacityPlan:
    """The per-rank plan of a config at T and E (ValueError naming the sizes when they cannot split it)."""
    check_sizes(cfg, tp, ep)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    v4 = is_v4(cfg)
    kv_format = {"auto": "fp8" if v4 else "bf16", "bfloat16": "bf16", "fp8": "fp8"}[kv_cache_dtype]
    weights = v4_weights(cfg, tp, ep) if v4 else llama_weights(cfg, tp)
    whole = v4_weights(cfg, 1, 1) if v4 else llama_weights(cfg, 1)
    kv = v4_kv(cfg, kv_format) if v4 else llama_kv(cfg, tp, kv_format)
    notes = ()
    if v4 and cfg.get("num_nextn_predict_layers"):
        notes = (f"{cfg['num_nextn_predict_layers']} MTP layer(s) not counted: loaded only with "
                 "--speculative-method mtp",)
    return CapacityPlan(cfg["model_type"], tp, ep, tuple(weights), tuple(kv), kv_format,
                        max_model_len or cfg.get("max_position_embeddings") or 4096,
                        parse_size(device_memory, "device memory"), gpu_memory_utilization,
                        sum(w.nbytes for w in whole), notes)
