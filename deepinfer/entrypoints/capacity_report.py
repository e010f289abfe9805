"""The capacity plan as `deepinfer info` prints it (see `capacity_plan`; the KV figures are the engine's
sizing, `worker/cache_sizing.py`).

Every figure is an exact byte count (commas) with a decimal GB beside the large ones, so a reader, or
a test, can check it against the config's fields.
"""

from __future__ import annotations

import argparse
import math
import os

from deepinfer.entrypoints.capacity_plan import (
    CSA,
    DEFAULT_DEVICE_MEMORY,
    HCA,
    CapacityPlan,
    is_mla,
    is_v4,
    load_config,
    plan_capacity,
)


def num(value: float) -> str:
    """1234 -> '1,234', 94.875 -> '94.875' (per-token bytes may be fractional: row_bytes / m)."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0")


def gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB"


def split_notes(cfg: dict, tp: int, ep: int) -> dict[str, str]:
    """How each weight part is spread over the ranks."""
    vocab = f"{math.ceil(cfg['vocab_size'] / tp):,} of {cfg['vocab_size']:,} vocab rows per rank" + \
        (" (tied: one matrix)" if cfg.get("tie_word_embeddings") else "")
    heads = f"{cfg['num_attention_heads'] // tp} of {cfg['num_attention_heads']} heads per rank"
    if is_mla(cfg):
        return mla_split_notes(cfg, tp, ep, heads)
    if not is_v4(cfg):
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        kv_note = f"{kv // tp} of {kv} kv heads" if kv >= tp else f"1 of {kv} kv heads (replicated {tp // kv}x)"
        return {"attention": f"{heads}, {kv_note}", "MLP": f"intermediate {cfg['intermediate_size'] // tp:,} of "
                f"{cfg['intermediate_size']:,} per rank", "norms": "replicated", "embedding + LM head": vocab}
    experts = cfg["n_routed_experts"]
    return {"routed experts": f"{experts // ep} of {experts} experts per layer per rank, each slice on {tp // ep} "
                              f"rank(s)",
            "shared experts": "whole on every rank",
            "attention": f"{heads}, {cfg['o_groups'] // tp} of {cfg['o_groups']} o_groups; q_a_proj, kv_proj "
                         "replicated",
            "compressors + indexer": "replicated", "routers": "replicated", "mHC": "replicated",
            "embedding + LM head": "whole on every rank"}


def mla_split_notes(cfg: dict, tp: int, ep: int, heads: str) -> dict[str, str]:
    experts, inter = cfg["n_routed_experts"], cfg["intermediate_size"]
    shared = cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)
    return {"attention": f"{heads}: q_b_proj, kv_b_proj, o_proj split; q_a_proj, kv_a_proj_with_mqa replicated",
            "MLP": f"intermediate {inter // tp:,} of {inter:,} per rank",
            "routed experts": f"{experts // ep} of {experts} experts per layer per rank, each slice on {tp // ep} "
                              f"rank(s)",
            "shared experts": f"intermediate {shared // tp:,} of {shared:,} per rank",
            "embedding + LM head": "whole on every rank (the MTP drafter reads them)"}


def weight_lines(plan: CapacityPlan, cfg: dict) -> list[str]:
    notes = split_notes(cfg, plan.tp, plan.ep)
    lines = ["weights per rank (stored formats):"]
    for part, (params, nbytes) in plan.part_totals().items():
        lines.append(f"  {part}: {params:,} params, {nbytes:,} B ({gb(nbytes)}) [{notes.get(part, 'replicated')}]")
    params = sum(w.params for w in plan.weights)
    ranks = plan.tp
    lines.append(f"  total per rank: {params:,} params, {plan.weight_bytes:,} B ({gb(plan.weight_bytes)}); "
                 f"all {ranks} ranks: {plan.weight_bytes * ranks:,} B ({gb(plan.weight_bytes * ranks)}); the model "
                 f"unsplit: {plan.model_weight_bytes:,} B ({gb(plan.model_weight_bytes)})")
    return lines


_LABELS = {"full": "full-attention K|V rows", "csa": "CSA latent rows", "index": "CSA index keys",
           "hca": "HCA latent rows", "mtp": "MTP window ring", "mla": "MLA latent rows (K = V)"}


def group_label(group, v4: bool) -> str:
    if group.is_ring and group.name != "mtp":
        return "window ring" if v4 else f"sliding-window ring{'' if group.name == 'swa' else f' (W={group.window})'}"
    return _LABELS.get(group.name, group.name)


def kv_group_line(group, v4: bool) -> str:
    """One cache group of the engine's sizing: bytes per token (paged) or per request (ring)."""
    label = group_label(group, v4)
    if group.is_ring:
        return (f"  {label}: {group.num_layers} layers x {group.rows_per_unit} rows (S) x {group.row_bytes:,} B "
                f"= {group.per_request:,} B per request (W = {group.window} visible rows)")
    m = group.compress_ratio
    per_token = f"{num(group.row_bytes / m)} B per token per layer"
    return (f"  {label}: {group.num_layers} layers x {group.row_bytes:,} B / {m} ({per_token}) "
            f"= {num(group.per_token)} B per token")


def per_kind_line(plan: CapacityPlan, cfg: dict) -> str:
    """Bytes per token per layer of each compressed kind (DeepSeek-V4: CSA rows + index keys, HCA rows)."""
    kinds = []
    for kind, label in ((CSA, "CSA"), (HCA, "HCA")):
        layers = [i for i, t in enumerate(cfg["layer_types"]) if t == kind]
        if layers:
            kinds.append(f"{label} {num(plan.kv.layer_per_token(layers[0]))} B per token per layer x {len(layers)}")
        else:
            kinds.append(f"no {label} layers")
    return "  per kind: " + ", ".join(kinds)


def kv_lines(plan: CapacityPlan, cfg: dict) -> list[str]:
    fmt = "MXFP8 rows (e4m3 + one UE8M0 byte per 32 values)" if plan.kv_format == "fp8" else "bf16 rows"
    v4 = is_v4(cfg)
    if v4:
        where = ("replicated on every rank, not split: the latent is one shared row per token (MQA, K = V) "
                 "that every rank's heads read; so are the index keys, rings and compressor state")
    elif is_mla(cfg):
        where = ("replicated on every rank, not split: the latent is one shared row per token (K = V) that every "
                 "rank's heads read")
    else:
        where = "split with the kv heads (each rank keeps K and V of its own kv heads)"
    kv = plan.kv
    lines = [f"KV cache per rank ({fmt}; {where}; rings sized for k = {kv.num_speculative_tokens} draft tokens):",
             *(kv_group_line(g, v4) for g in kv.groups)]
    if kv.state_bytes:
        lines.append(f"  per-request state (compressor state, fp32): {kv.state_bytes:,} B per request")
    if kv.paged:
        rows = ", ".join(f"{group_label(g, v4)} {g.rows_per_unit}" for g in kv.paged)
        lines.append(f"  pages of {kv.page_bytes:,} B, one pool for the paged groups; rows per block: {rows}")
    if v4:
        lines.append(per_kind_line(plan, cfg))
    if is_mla(cfg):
        lines.append(mla_row_line(cfg))
    lines.append(f"  KV bytes per token: {num(plan.kv_per_token)} B; fixed per request: {plan.kv_per_request:,} B")
    return lines


def mla_row_line(cfg: dict) -> str:
    """One latent row in both row formats the engine has, as its row codec stores them."""
    import torch

    from deepinfer.model_executor.layers.attention.layer_cache import RowCodec

    r, dr, layers = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["num_hidden_layers"]
    bf16, fp8 = (RowCodec(1, r + dr, torch.bfloat16, fmt, shared_kv=True).row_bytes for fmt in ("bfloat16", "fp8"))
    return (f"  latent row: {r} + {dr} = {r + dr} values per layer per token (K = V, no factor 2): bf16 {bf16:,} B, "
            f"MXFP8 {fp8:,} B ({r + dr} e4m3 + {fp8 - (r + dr)} UE8M0 scale bytes); x {layers} layers = "
            f"{layers * bf16:,} B / {layers * fp8:,} B per token")


def capacity_lines(plan: CapacityPlan) -> list[str]:
    usable = int(plan.device_memory * plan.gpu_memory_utilization)
    length = plan.max_model_len
    one = plan.request_bytes(length)
    lines = [f"memory per rank: {plan.device_memory:,} B x {plan.gpu_memory_utilization} = {usable:,} B; "
             f"weights {plan.weight_bytes:,} B; left for the cache {plan.kv_budget:,} B ({gb(plan.kv_budget)}) "
             "(before activations)"]
    if plan.kv_budget <= 0:
        return lines + [f"capacity: the weights do not fit: {plan.weight_bytes:,} B > {usable:,} B usable per rank"]
    blocks = plan.kv.blocks_for(length)
    pages = f": {plan.kv_per_request:,} fixed + {blocks:,} pages" if blocks else ""
    return lines + [f"capacity: {plan.requests_that_fit(length):,} requests at {length:,} tokens at once "
                    f"({one:,} B = {gb(one)} each, per rank{pages})"]


def plan_lines(plan: CapacityPlan, cfg: dict, source: str = "") -> list[str]:
    head = (f"capacity plan: {plan.model_type}{f' ({source})' if source else ''}, tensor_parallel_size {plan.tp}, "
            f"expert_parallel_size {plan.ep} ({plan.tp} ranks)")
    return [head, *weight_lines(plan, cfg), *kv_lines(plan, cfg), *capacity_lines(plan),
            *(f"note: {n}" for n in plan.notes)]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def add_plan_args(p) -> None:
    """`info`'s capacity-plan flags; --tensor-parallel-size / --expert-parallel-size only where the shared
    engine flags do not already define them."""
    g = p.add_argument_group("capacity plan (printed when a parallel size above 1 is given)")
    have = {s for action in p._actions for s in action.option_strings}
    for flag in ("--tensor-parallel-size", "--expert-parallel-size"):
        if flag not in have:
            g.add_argument(flag, type=int, default=None, help="ranks the plan splits the model over")
    g.add_argument("--gpu-memory", default=DEFAULT_DEVICE_MEMORY, metavar="SIZE",
                   help="memory of one device for the plan (default: 141GB, one H200)")


def plan_sizes(args) -> tuple[int, int] | None:
    """(T, E) when the flags ask for a plan (a size above 1), else None."""
    tp, ep = args.tensor_parallel_size or 1, args.expert_parallel_size or 1
    return (tp, ep) if tp > 1 or ep > 1 else None


def is_config_only(args) -> bool:
    """A local directory with config.json and no weight files, and no --load-format dummy: plan without
    building (the model may be far larger than this machine)."""
    path = args.model
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return args.load_format != "dummy" and not any(
        name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path))


def print_plan(args, cfg: dict | None = None) -> None:
    """Print the plan of `cfg` (default: --model's config.json) at the flags' sizes."""
    from deepinfer.engine_args import EngineArgs

    tp, ep = plan_sizes(args) or (1, 1)
    cfg = load_config(args.model) if cfg is None else cfg
    one_rank = argparse.Namespace(**{**vars(args), "tensor_parallel_size": 1, "expert_parallel_size": 1})
    engine = EngineArgs.from_cli_args(one_rank).create_engine_config()  # the flags as the engine reads them
    plan = plan_capacity(cfg, tp, ep, max_model_len=args.max_model_len,
                         device_memory=args.gpu_memory,
                         gpu_memory_utilization=engine.cache.gpu_memory_utilization,
                         kv_cache_dtype=engine.cache.kv_cache_dtype, block_size=engine.cache.block_size,
                         speculative=engine.speculative, env=engine.env)
    print("\n".join(plan_lines(plan, cfg, args.model or "")))
