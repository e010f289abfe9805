"""Capacity plan for tensor / expert parallelism: per-rank weight bytes in their stored formats (from
config.json), KV bytes per token and per request (from the model itself), and the requests that fit at a
context length in what a device has left after the weights.

Splits (T = tensor_parallel_size ranks, E = expert_parallel_size):

    Llama family   q/o: heads / T            k/v: kv heads / T (1 per rank, replicated, when kv < T)
                   MLP: intermediate / T     embedding, LM head: ceil(vocab / T) rows   norms: replicated
    DeepSeek-V4    q_b / o_a / o_b / sinks: heads / T (o_groups / T groups per rank)
                   q_a, kv_proj, compressors, indexer, routers, norms, mHC: replicated
                   shared expert: intermediate / T     routed experts: n_routed_experts / E per rank
                   (each slice held by T / E ranks)    embedding, LM head: ceil(vocab / T) rows
    DeepSeek-V2/V3 q_b (or q) / kv_b / o: heads / T      q_a, kv_a_proj_with_mqa, routers, norms: replicated
    (MLA)          dense MLPs, shared experts: intermediate / T     routed experts: n_routed_experts / E
                   embedding, LM head: whole on every rank (the MTP drafter reads them)

The KV cache is the engine's own sizing: rank 0 of T is built on the meta device (shapes, no values)
and its declared cache groups and per-request state go through `worker.cache_sizing.plan_model_cache`
with the engine's settings (block size, row format, the draft allowance k that sizes the rings), as
`ModelRunner` sizes them. A Llama-family layer's rows hold the rank's kv heads; DeepSeek-V4's latent is
ONE shared row per token (MQA, K = V) that every rank's heads read, so it is replicated on every rank,
not split; so are the index keys, the window rings and the compressor state. MLA's latent row
(kv_lora_rank + qk_rope_head_dim values, K = V) is replicated the same way.

Stored formats: DeepSeek-V4's `quantization_config` gives FP4 routed experts (0.5 B per value + one
UE8M0 byte per 32 values) and FP8 projections (1 B per value + one scale per 128 x 128 block);
embeddings, LM head and routers stay in `torch_dtype`, mHC, sinks and position biases in fp32.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.config import CacheConfig, EngineConfig, SpeculativeConfig, parse_size
from deepinfer.environ import Environ

if TYPE_CHECKING:
    from deepinfer.worker.cache_sizing import CacheSizing

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
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
class CapacityPlan:
    """What one rank holds for a model at tensor_parallel_size T and expert_parallel_size E."""

    model_type: str
    tp: int
    ep: int
    weights: tuple[Weight, ...]
    kv: CacheSizing  # one rank's cache, as the engine sizes it
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
        return self.kv.per_token

    @property
    def kv_per_request(self) -> int:
        return self.kv.per_request

    def request_bytes(self, num_tokens: int) -> int:
        """Bytes one request of `num_tokens` tokens takes: its fixed part and its pages of the pool."""
        return self.kv.request_bytes(num_tokens)

    @property
    def kv_budget(self) -> int:
        """Bytes left for the cache on one rank: the usable memory minus the rank's weights."""
        return int(self.device_memory * self.gpu_memory_utilization) - self.weight_bytes

    def requests_that_fit(self, num_tokens: int) -> int:
        return self.kv.requests_that_fit(self.kv_budget, num_tokens)


def is_v4(cfg: dict) -> bool:
    return cfg.get("model_type") == "deepseek_v4"


def is_mla(cfg: dict) -> bool:
    """DeepSeek-V2 / V3 (multi-head latent attention: one shared latent row per token)."""
    return cfg.get("model_type") in ("deepseek_v2", "deepseek_v3")


def check_sizes(cfg: dict, tp: int, ep: int) -> None:
    """ValueError naming the sizes when T or E cannot split this model."""
    for name, value in (("tensor_parallel_size", tp), ("expert_parallel_size", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    heads = cfg["num_attention_heads"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}")
    experts = routed_expert_count(cfg)
    if ep > 1 and not experts:
        raise ValueError(f"expert_parallel_size={ep} but {cfg.get('model_type')} has no routed experts")
    if ep > tp or tp % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide tensor_parallel_size={tp} "
                         "(the expert-parallel ranks are the tensor-parallel ranks)")
    if experts % ep:
        raise ValueError(f"{routed_expert_field(cfg)}={experts} is not divisible by expert_parallel_size={ep}")
    for field in _split_fields(cfg):
        if cfg[field] % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={cfg[field]}")
    kv = cfg.get("num_key_value_heads") or heads
    if not is_v4(cfg) and not is_mla(cfg) and kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={kv}: one must divide the other")


def _split_fields(cfg: dict) -> list[str]:
    if is_v4(cfg):
        return ["o_groups", "moe_intermediate_size"]
    if is_mla(cfg):
        return ["intermediate_size", "moe_intermediate_size"]
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


_EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")  # DeepSeek, Qwen MoE, Mixtral / GPT-OSS


def routed_expert_field(cfg: dict) -> str:
    """The config field that counts the routed experts per MoE layer ("n_routed_experts" if none does)."""
    return next((f for f in _EXPERT_FIELDS if cfg.get(f)), _EXPERT_FIELDS[0])


def routed_expert_count(cfg: dict) -> int:
    """Routed experts per MoE layer, 0 for a dense model."""
    return cfg.get(routed_expert_field(cfg)) or 0


def sparse_layer_count(cfg: dict) -> int:
    """Layers of a Llama-family MoE whose MLP is routed experts (Qwen MoE: not in `mlp_only_layers`,
    every `decoder_sparse_step`-th; Mixtral and GPT-OSS: all)."""
    n = cfg["num_hidden_layers"]
    if not cfg["model_type"].startswith("qwen"):
        return n
    dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
    return sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)


def llama_mlp(cfg: dict, tp: int, ep: int) -> list[Weight]:
    """Dense MLPs split by T; routed experts E/ep per rank (held whole: every rank's with ep = 1),
    Qwen2-MoE's shared expert and gate and the routers replicated; GPT-OSS's MXFP4 experts packed."""
    h, dtype, experts = cfg["hidden_size"], weight_dtype(cfg), routed_expert_count(cfg)
    sparse = sparse_layer_count(cfg) if experts else 0
    dense, inter = cfg["num_hidden_layers"] - sparse, cfg["intermediate_size"] // tp
    out = [Weight("MLP", 2 * inter, h, dense, dtype), Weight("MLP", h, inter, dense, dtype)]
    if not sparse:
        return out
    expert_inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    quant = cfg.get("quantization_config") or {}
    fmt = "fp4" if quant.get("quant_method") == "mxfp4" else dtype
    held = experts // ep * sparse
    out += [Weight("routed experts", 2 * expert_inter, h, held, fmt),
            Weight("routed experts", h, expert_inter, held, fmt), Weight("routers", experts, h, sparse, dtype)]
    if cfg["model_type"] == "gpt_oss":  # expert and router biases
        out += [Weight("routed experts", 1, 2 * expert_inter + h, held, dtype),
                Weight("routers", 1, experts, sparse, dtype)]
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if cfg["model_type"] == "qwen2_moe" and shared:
        out += [Weight("shared expert", 2 * shared, h, sparse, dtype),
                Weight("shared expert", h, shared, sparse, dtype), Weight("shared expert", 1, h, sparse, dtype)]
    return out


def llama_weights(cfg: dict, tp: int, ep: int = 1) -> list[Weight]:
    """Llama-family weights one rank holds (Megatron layout): Llama / Qwen / Mistral, Gemma 2 and 3,
    Phi-3, and the MoE members (Qwen MoE, Mixtral, GPT-OSS)."""
    h, d, n = cfg["hidden_size"], head_dim_of(cfg), cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"] // tp
    kv = max(1, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // tp)
    model_type, dtype = cfg["model_type"], weight_dtype(cfg)
    gemma = model_type.startswith("gemma")
    out = [Weight("attention", (heads + 2 * kv) * d, h, n, dtype), Weight("attention", h, heads * d, n, dtype),
           *llama_mlp(cfg, tp, ep), Weight("norms", 1, h, n * (4 if gemma else 2) + 1, dtype)]
    if model_type in ("qwen2", "qwen2_moe") or cfg.get("attention_bias"):
        out.append(Weight("attention", 1, (heads + 2 * kv) * d, n, dtype))
    if model_type in ("qwen3", "qwen3_moe") or model_type.startswith("gemma3"):
        out.append(Weight("norms", 1, d, 2 * n, dtype))
    if model_type == "gpt_oss":  # o_proj's bias and a sink per head
        out.append(Weight("attention", 1, h + heads, n, dtype))
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


def mla_attention(cfg: dict, tp: int, proj: str, sb: int) -> list[Weight]:
    """Per layer: q_a_proj (+ norm), kv_a_proj_with_mqa (+ norm) replicated; q_b_proj (or q_proj),
    kv_b_proj and o_proj split by heads."""
    h, n, norm = cfg["hidden_size"], cfg["num_hidden_layers"], weight_dtype(cfg)
    heads = cfg["num_attention_heads"] // tp
    r, dr, dn, dv, ql = (cfg[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                                          "q_lora_rank"))
    query = [Weight("attention", heads * (dn + dr), h, n, proj, sb)]
    if ql:
        query = [Weight("attention", ql, h, n, proj, sb), Weight("attention", 1, ql, n, norm),
                 Weight("attention", heads * (dn + dr), ql, n, proj, sb)]
    return query + [Weight("attention", r + dr, h, n, proj, sb), Weight("attention", 1, r, n, norm),
                    Weight("attention", heads * (dn + dv), r, n, proj, sb),
                    Weight("attention", h, heads * dv, n, proj, sb)]


def mla_ffn(cfg: dict, tp: int, ep: int, proj: str, sb: int) -> list[Weight]:
    """Dense MLPs (the first first_k_dense_replace layers) and shared experts split by T, routed experts
    n_routed_experts / E per rank, routers (+ V3's correction bias) replicated."""
    h, n, dense = cfg["hidden_size"], cfg["num_hidden_layers"], cfg.get("first_k_dense_replace") or 0
    inter, moe_inter, experts = cfg["intermediate_size"] // tp, cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    shared, moe = moe_inter * (cfg.get("n_shared_experts") or 0) // tp, n - dense
    out = [Weight("dense MLP", 2 * inter, h, dense, proj, sb), Weight("dense MLP", h, inter, dense, proj, sb),
           Weight("routed experts", 2 * moe_inter, h, experts // ep * moe, proj, sb),
           Weight("routed experts", h, moe_inter, experts // ep * moe, proj, sb),
           Weight("shared experts", 2 * shared, h, moe, proj, sb), Weight("shared experts", h, shared, moe, proj, sb),
           Weight("routers", experts, h, moe, weight_dtype(cfg))]
    if cfg["model_type"] == "deepseek_v3":
        out.append(Weight("routers", 1, experts, moe, "fp32"))
    return out


def mla_weights(cfg: dict, tp: int, ep: int) -> list[Weight]:
    _, proj, sb = v4_formats(cfg)  # V3 ships FP8 linears with fp32 weight_scale_inv per 128 x 128 block
    norms = Weight("norms", 1, cfg["hidden_size"], 2 * cfg["num_hidden_layers"] + 1, weight_dtype(cfg))
    return [*mla_ffn(cfg, tp, ep, proj, sb), *mla_attention(cfg, tp, proj, sb), norms, *vocab_weights(cfg, 1)]


def model_weights(cfg: dict, tp: int, ep: int) -> list[Weight]:
    """One rank's weights at T and E, in their stored formats."""
    if is_v4(cfg):
        return v4_weights(cfg, tp, ep)
    return mla_weights(cfg, tp, ep) if is_mla(cfg) else llama_weights(cfg, tp, ep)


def hf_config_of(cfg: dict):
    """The transformers config object of a config dict (as `AutoConfig.from_pretrained` reads it)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def meta_model(cfg: dict, tp: int, ep: int, max_positions: int, speculative_method: str | None = None):
    """Rank 0 of `tp` of the model `cfg` describes, built as the engine builds it but on the meta device
    (`shapes_only_dummy_weights`: shapes and dtypes, no values, no memory)."""
    import torch

    from deepinfer.distributed.parallel_state import as_rank
    from deepinfer.model_executor.loader.model_source import ModelSource
    from deepinfer.model_executor.model_loader import build_model, shapes_only_dummy_weights

    source = ModelSource(path="", format="hf", hf_config=hf_config_of(cfg), tokenizer=None, identity="",
                         load_format="dummy")
    with as_rank(0, tp), shapes_only_dummy_weights():
        return build_model(source, torch.bfloat16, torch.device("meta"), max_positions, speculative_method,
                           expert_parallel_size=ep)


def plan_kv(cfg: dict, tp: int, ep: int, kv_format: str, max_model_len: int, block_size: int,
            engine: EngineConfig) -> CacheSizing:
    """One rank's cache of the meta-built model, sized as the engine sizes it (bf16 compute, rows in
    `kv_format`, the engine's block size and draft allowance k)."""
    import torch

    from deepinfer.worker.cache_sizing import plan_model_cache

    model = meta_model(cfg, tp, ep, max_model_len, engine.speculative.method)
    kv_cache_dtype = "fp8" if kv_format == "fp8" else "bfloat16"
    return plan_model_cache(model, torch.bfloat16, kv_cache_dtype, block_size, engine.env,
                            engine.speculative.num_speculative_tokens)[2]


def engine_settings(speculative: SpeculativeConfig | None, env: Environ | None) -> EngineConfig:
    """The engine's resolution of the draft setting: k = num_speculative_tokens, else
    DEEPINFER_USE_NEXTN_DECODE of `env` (the process environment when None)."""
    return EngineConfig(speculative=dataclasses.replace(speculative) if speculative else None, env=env)


def plan_capacity(cfg: dict, tp: int = 1, ep: int = 1, max_model_len: int | None = None,
                  device_memory: int | str = DEFAULT_DEVICE_MEMORY,
                  gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization,
                  kv_cache_dtype: str = CacheConfig.kv_cache_dtype, block_size: int = CacheConfig.block_size,
                  speculative: SpeculativeConfig | None = None, env: Environ | None = None) -> CapacityPlan:
    """The per-rank plan of a config at T and E (ValueError naming the sizes when they cannot split it).
    `speculative` and `env` are the engine's: k sizes the rings (S = W + max(backtracking, k + 1))."""
    check_sizes(cfg, tp, ep)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    v4 = is_v4(cfg)
    kv_format = {"auto": "fp8" if v4 else "bf16", "bfloat16": "bf16", "fp8": "fp8"}[kv_cache_dtype]
    weights, whole = model_weights(cfg, tp, ep), model_weights(cfg, 1, 1)
    usable = int(parse_size(device_memory, "device memory") * gpu_memory_utilization)
    max_model_len = max_model_len or cfg.get("max_position_embeddings") or 4096
    engine = engine_settings(speculative, env)
    kv = plan_kv(cfg, tp, ep, kv_format, max_model_len, block_size, engine)
    notes = plan_notes(cfg, kv_cache_dtype, engine) + mla_notes(cfg, weights, usable)
    return CapacityPlan(cfg["model_type"], tp, ep, tuple(weights), kv, kv_format, max_model_len,
                        parse_size(device_memory, "device memory"), gpu_memory_utilization,
                        sum(w.nbytes for w in whole), notes)


def plan_notes(cfg: dict, kv_cache_dtype: str, engine: EngineConfig) -> tuple[str, ...]:
    """What the plan leaves out or assumes."""
    notes = []
    if is_v4(cfg) and kv_cache_dtype == "auto":
        notes.append("--kv-cache-dtype auto is planned as MXFP8 rows for deepseek_v4 (the engine's auto is "
                     "the compute dtype: pass --kv-cache-dtype fp8 to run what is planned)")
    if is_v4(cfg) and cfg.get("num_nextn_predict_layers"):
        mtp = engine.speculative.method == "mtp"
        cache = "their window ring counted" if mtp else "nor their cache: loaded only with --speculative-method mtp"
        notes.append(f"{cfg['num_nextn_predict_layers']} MTP layer(s): weights not counted, {cache}")
    return tuple(notes)


def mla_notes(cfg: dict, weights: list[Weight], usable: int) -> tuple[str, ...]:
    """DeepSeek-V2 / V3: the MTP layers left out, and what FP8 weights take once loaded (the model
    dequantizes them to the compute dtype as it reads them), against the `usable` bytes of a rank."""
    if not is_mla(cfg):
        return ()
    notes = []
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"{cfg['num_nextn_predict_layers']} MTP layer(s): weights not counted; with --speculative-method "
                     "mtp their rows take a ring as long as the model length per request")
    fp8 = [w for w in weights if w.fmt == "fp8"]
    if fp8:
        resident = sum(w.nbytes for w in weights if w.fmt != "fp8") + sum(2 * w.params for w in fp8)
        where = "within" if resident <= usable else "more than"
        notes.append(f"FP8 weights are counted as stored; loading dequantizes them to the compute dtype: "
                     f"{resident:,} B ({resident / 1e9:,.2f} GB) per rank in bf16, {where} the {usable:,} B usable"
                     + ("" if resident <= usable else " (this split needs them kept packed, which the engine does "
                                                      "not do yet)"))
    return tuple(notes)
