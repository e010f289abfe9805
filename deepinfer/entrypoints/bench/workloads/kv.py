"""`deepinfer bench` on a model with compressed cache groups (DeepSeek-V4): `kv` lines with each
group's bytes as the engine allocated them against the sizing of the model's declared groups
(`worker/cache_sizing.plan_model_cache`, the one formula), per group:

    window ring (every layer)   layers x S x row_bytes per request, fixed (S = W + allowance, 134 for W = 128)
    CSA / HCA compressed rows   layers x row_bytes / m per token (m = 4 / 128)
    CSA index keys              layers x index_row_bytes / m per token
    compressor state            fp32, per request: the model's `state_bytes_per_slot`, against the
                                bytes of one slot of what it keeps (`read_state`)

and the payload at L = max_model_len by the book's formulas (visible rows only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.entrypoints.bench.common import Workload

_ROW_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def has_compressed_groups(runner) -> bool:
    return any(g.compress_ratio > 1 for g in runner.groups)


def row_format(elements: int, dtype, kv_cache_dtype: str):
    """The cache_common format of a row of `elements` values: MXFP8, or the compute dtype."""
    from deepinfer.model_executor.layers.ops.cache_common import mxfp8_format, unquantized_format

    if kv_cache_dtype == "fp8":
        return mxfp8_format(elements)
    return unquantized_format(elements, "bf16" if kv_cache_dtype == "bfloat16" else _ROW_DTYPES[str(dtype)])


def planned_sizing(runner, cache_config):
    """The sizing of the model's declared groups with the engine's settings, derived afresh."""
    from deepinfer.worker.cache_sizing import plan_model_cache

    return plan_model_cache(runner.model, runner.dtype, cache_config.kv_cache_dtype, cache_config.block_size,
                            runner.config.env, runner.config.speculative.num_speculative_tokens)[2]


def engine_group_bytes(runner, gi: int) -> tuple[float, int]:
    """(bytes per token, fixed bytes per request) of group gi from the engine's allocation."""
    group, cache = runner.groups[gi], runner.caches.cache
    if group.is_ring:
        return 0.0, cache.allocations[gi].shape[1]  # one state slot: [units, unit_bytes]
    return cache.unit_bytes(gi) / (group.rows_per_unit * group.compress_ratio), 0


def formula_text(g) -> str:
    if g.is_ring:
        return f"{g.num_layers} layers x S {g.rows_per_unit} x {g.row_bytes} B"
    return f"{g.num_layers} x {g.row_bytes} B / {g.compress_ratio}"


def kept_state_bytes(model) -> int:
    """Bytes of one state slot's per-request state as the model keeps it (its float tensors)."""
    return sum(t.numel() * t.element_size() for t in model.read_state(0).values() if t.is_floating_point())


def book_payload_bytes(cfg, dtype, kv_cache_dtype: str, num_tokens: int) -> int:
    """The payload of one request at num_tokens tokens by the book's formulas: visible rows only
    (min(L, W) window rows per layer, floor(L / m) compressed rows and index keys per CSA / HCA
    layer), no ring allowance, block padding or compressor state."""
    from deepinfer.model_executor.layers.ops.cache_common import row_payload_bytes, visible_rows

    latent = row_format(cfg.head_dim, dtype, kv_cache_dtype)
    index = row_format(cfg.index_head_dim, dtype, kv_cache_dtype)
    total = 0
    for kind in cfg.layer_types:
        total += row_payload_bytes(visible_rows(num_tokens, cfg.sliding_window), latent)
        if kind in cfg.compress_rates:
            rows = num_tokens // cfg.compress_rates[kind]
            total += row_payload_bytes(rows, latent)
            if kind == "compressed_sparse_attention":
                total += row_payload_bytes(rows, index)
    return total


def kv_lines(llm) -> list[str]:
    """Engine figures (allocation units) per group against the formula, then the book's payload."""
    from deepinfer.entrypoints.info import fmt_bytes

    engine, runner = llm.engine, llm.engine.runner
    cfg = engine.source.hf_config
    if not has_compressed_groups(runner):  # only DeepSeek-V4's, one per entry of cfg.compress_rates
        return []
    kv_dtype = engine.config.cache.kv_cache_dtype
    plan = planned_sizing(runner, engine.config.cache)
    lines, total_token, total_request = [], 0.0, 0
    for gi, (g, want) in enumerate(zip(runner.groups, plan.groups, strict=True)):
        per_token, per_request = engine_group_bytes(runner, gi)
        ok = "ok" if (per_token, per_request) == (want.per_token, want.per_request) else "MISMATCH"
        what = f"{fmt_bytes(per_request)} B per request, fixed" if g.is_ring else f"{fmt_bytes(per_token)} B per token"
        wanted = f"{fmt_bytes(want.per_request)} B" if g.is_ring else f"{fmt_bytes(want.per_token)} B"
        shape = f"ring of S = {g.rows_per_unit} rows per layer" if g.is_ring else f"1 row per {g.compress_ratio} tokens"
        lines.append(f"kv       {g.name:6s} {g.kind:5s} {want.num_layers} layers, rows of {want.row_bytes:,} B, "
                     f"{shape}: engine {what}; formula {formula_text(want)} = {wanted} [{ok}]")
        total_token += per_token
        total_request += per_request
    state, want_state = kept_state_bytes(runner.model), plan.state_bytes
    lines.append(f"kv       state  fp32 compressor state: engine {state:,} B per request; formula "
                 f"state_bytes_per_slot = {want_state:,} B [{'ok' if state == want_state else 'MISMATCH'}]")
    lines.append(f"kv       total  {fmt_bytes(total_token)} B per token + {total_request + state:,} B per request "
                 f"(rings {total_request:,} + state {state:,})")
    length = engine.max_model_len
    payload = book_payload_bytes(cfg, runner.dtype, kv_dtype, length)
    dense = len(cfg.layer_types) * row_format(cfg.head_dim, runner.dtype, kv_dtype).bytes_per_row
    lines.append(f"kv       book   payload at L = {length:,} (visible rows: min(L, W) window + floor(L / m) "
                 f"compressed per layer): {payload:,} B = {fmt_bytes(round(payload / length, 3))} B per token; "
                 f"every token's latent row in every layer would be {dense:,} B per token")
    return lines


def workload_kv_line(runner, workload: Workload) -> str:
    """Bytes the engine allocates for the workload's requests at their final lengths (rings,
    block padding and compressor state included), per token."""
    from deepinfer.entrypoints.info import fmt_bytes

    lengths = [len(p) + o for p, o in zip(workload.prompts, workload.output_lens, strict=True)]
    allocated = sum(runner.caches.sizing.request_bytes(n) for n in lengths)
    return (f"kv       {workload.name:6s} allocated for its {len(lengths)} requests at their final lengths "
            f"({sum(lengths):,} tokens): {allocated:,} B = {fmt_bytes(round(allocated / sum(lengths), 3))} B per token")
