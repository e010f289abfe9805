"""Capacity plan for tensor / expert parallelism: per-rank weight bytes in their stored formats (from
config.json), KV bytes per token and per request (from the model itself), and the requests that fit at a
context length in what a device has left after the weights.

Splits, as the models build a rank (T = tensor_parallel_size ranks, E = expert_parallel_size):

    Llama family   q/o: heads / T            k/v: kv heads / T (1 per rank, replicated, when kv < T)
                   MLP: intermediate / T     embedding, LM head: ceil(vocab / T) rows   norms: replicated
    DeepSeek-V4    q_b / o_a / o_b / sinks: heads / T (o_groups / T groups per rank)
                   q_a, kv_proj, compressors, indexer, routers, norms, mHC: replicated
                   routed experts: n_routed_experts / E per rank (each slice held by T / E ranks)
                   shared experts, embedding, LM head: whole on every rank
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

The weights are the same build's parameters, the whole model's a second build at one rank (neither with
the MTP layers): no family is described here. Each parameter is counted in the format the checkpoint stores
it in, which its layer declares (`param_storage`, `contracts/weight_storage.py`) and the config's
`quantization_config` resolves: DeepSeek's FP4 routed experts (0.5 B per value + one UE8M0 byte per 32
values) and FP8 projections (1 B per value + one scale per 128 x 128 block), GPT-OSS's MXFP4 experts as
held packed; embeddings, LM head and routers in `torch_dtype`, mHC, sinks and position biases in fp32.
Its part (attention, MLP, routed experts, ...) is read off its module path.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.config import CacheConfig, EngineConfig, SpeculativeConfig, parse_size
from deepinfer.contracts.weight_storage import CHECKPOINT, LINEAR, CheckpointFormats
from deepinfer.environ import Environ

if TYPE_CHECKING:
    from deepinfer.worker.cache_sizing import CacheSizing

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
DEFAULT_DEVICE_MEMORY = "141GB"  # one H200


def load_config(path: str) -> dict:
    """config.json of a model directory (or the file itself) as a dict; a multimodal config's text part."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(file) as f:
        cfg = json.load(f)
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


@dataclass(frozen=True)
class Weight:
    """One parameter tensor that ONE rank holds: its part of the model, its stored format, its values and
    stored bytes (`contracts/weight_storage.py`)."""

    part: str
    name: str
    fmt: str
    params: int
    nbytes: int


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


def weight_dtype(cfg: dict) -> str:
    return {"float32": "fp32", "float16": "fp16"}.get(cfg.get("torch_dtype") or cfg.get("dtype"), "bf16")


_EXPERT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")  # DeepSeek, Qwen MoE, Mixtral / GPT-OSS


def routed_expert_field(cfg: dict) -> str:
    """The config field that counts the routed experts per MoE layer ("n_routed_experts" if none does)."""
    return next((f for f in _EXPERT_FIELDS if cfg.get(f)), _EXPERT_FIELDS[0])


def routed_expert_count(cfg: dict) -> int:
    """Routed experts per MoE layer, 0 for a dense model."""
    return cfg.get(routed_expert_field(cfg)) or 0


def checkpoint_formats(cfg: dict) -> CheckpointFormats:
    """How the checkpoint stores each kind of parameter (`contracts/weight_storage.py`), from its config:
    `torch_dtype`, and `quantization_config` (DeepSeek's FP8 projections, FP4 / FP8 routed experts)."""
    qc = cfg.get("quantization_config") or {}
    return CheckpointFormats(dtype=weight_dtype(cfg), linear="fp8" if qc.get("quant_method") == "fp8" else "",
                             experts={"fp4": "fp4", "fp8": "fp8"}.get(qc.get("expert_dtype"), ""),
                             scale_bytes=1 if qc.get("scale_fmt") == "ue8m0" else 4)


VOCAB = "embedding + LM head"
# (names in a parameter's module path, its part): the first match wins
_PART_NAMES = ((VOCAB, ("embed_tokens", "lm_head")), ("routed experts", ("experts",)),
               ("shared expert", ("shared_expert", "shared_expert_gate")), ("shared experts", ("shared_experts",)),
               ("compressors + indexer", ("compressor", "indexer")), ("routers", ("gate", "router")),
               ("attention", ("self_attn", "attn")), ("MLP", ("mlp", "ffn")))
PARTS = ("attention", "compressors + indexer", "MLP", "routed experts", "routers", "shared expert", "shared experts",
         "mHC", "norms", VOCAB, "other")  # the printed order


def part_of(module_name: str) -> str:
    """The part of the model a parameter of module `module_name` belongs to, read off the module path:
    a norm wherever it sits is one of the norms, a hyper-connection (`*_hc`, `hc_*`) the mHC."""
    path = module_name.split(".")
    if "norm" in path[-1]:
        return "norms"
    if any(n.endswith("_hc") or n.startswith("hc_") for n in path):
        return "mHC"
    return next((part for part, names in _PART_NAMES if any(n in path for n in names)), "other")


def param_kinds(module) -> dict[str, str]:
    """The storage kinds `module` declares (`param_storage`); a linear layer's weight is LINEAR."""
    from torch import nn

    declared = getattr(module, "param_storage", {})
    return {"weight": LINEAR, **declared} if isinstance(module, nn.Linear) else declared


def weights_of(model, formats: CheckpointFormats) -> list[Weight]:
    """Every parameter of `model` (a meta-built rank) in the format the checkpoint stores it in, by part."""
    out, seen = [], set()
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) not in seen:  # a tied weight counts once
                seen.add(id(p))
                out.append(stored_weight(module_name, module, leaf, p, formats))
    return sorted(out, key=lambda w: PARTS.index(w.part))


def stored_weight(module_name: str, module, leaf: str, p, formats: CheckpointFormats) -> Weight:
    """Parameter `leaf` of `module` in the kind its layer declares; the embedding and the LM head in the
    checkpoint dtype (quantized checkpoints leave them be), an integer tensor in its own dtype."""
    part = part_of(module_name)
    kind = CHECKPOINT if part == VOCAB else param_kinds(module).get(leaf, CHECKPOINT)
    if kind == CHECKPOINT and not p.is_floating_point():
        fmt = str(p.dtype).removeprefix("torch.")
    else:
        fmt = formats.format_of(kind)
    pieces = tuple(getattr(module, "shard_sizes", ())) if kind == LINEAR else ()  # stored apart: q|k|v, gate|up
    values, nbytes = formats.values_and_bytes(fmt, tuple(p.shape), pieces)
    return Weight(part, f"{module_name}.{leaf}".lstrip("."), fmt, values, nbytes)


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


def plan_weights(cfg: dict, tp: int, ep: int, max_positions: int):
    """(rank 0 of T built on the meta device, its weights, the whole model's stored bytes at one rank)."""
    formats = checkpoint_formats(cfg)
    model = meta_model(cfg, tp, ep, max_positions)
    weights = weights_of(model, formats)
    whole = weights if tp == ep == 1 else weights_of(meta_model(cfg, 1, 1, max_positions), formats)
    return model, weights, sum(w.nbytes for w in whole)


def plan_kv(model, kv_format: str, block_size: int, engine: EngineConfig) -> CacheSizing:
    """One rank's cache of the meta-built `model`, sized as the engine sizes it (bf16 compute, rows in
    `kv_format`, the engine's block size and draft allowance k)."""
    import torch

    from deepinfer.worker.cache_sizing import plan_model_cache

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
    formats = {"auto": "fp8" if v4 else "bf16", "bfloat16": "bf16", "fp8": "fp8"}  # the GPU row formats
    if kv_cache_dtype not in formats:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, formats))} for a device plan, "
                         f"got {kv_cache_dtype!r}")
    kv_format = formats[kv_cache_dtype]
    usable = int(parse_size(device_memory, "device memory") * gpu_memory_utilization)
    max_model_len = max_model_len or cfg.get("max_position_embeddings") or 4096
    engine = engine_settings(speculative, env)
    model, weights, whole = plan_weights(cfg, tp, ep, max_model_len)
    if engine.speculative.method == "mtp":  # the drafter's layers: their cache counts, their weights not
        model = meta_model(cfg, tp, ep, max_model_len, "mtp")
    kv = plan_kv(model, kv_format, block_size, engine)
    notes = plan_notes(cfg, kv_cache_dtype, engine) + mla_notes(cfg, weights, usable)
    return CapacityPlan(cfg["model_type"], tp, ep, tuple(weights), kv, kv_format, max_model_len,
                        parse_size(device_memory, "device memory"), gpu_memory_utilization, whole, notes)


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
