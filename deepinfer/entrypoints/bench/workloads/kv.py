"""`deepinfer bench` on a model with compressed cache groups (DeepSeek-V4): `kv` lines with each
group's bytes from the engine's allocation units against the formula from its config, per layer type:

    window ring (every layer)   S * row_bytes per request, fixed (S = W + allowance, 134 for W = 128)
    CSA / HCA compressed rows   row_bytes / m per token (m = 4 / 128)
    CSA index keys              index_row_bytes / m per token
    compressor state            fp32, per request: CSA 6 * m * (D + D_index) * 4, HCA 2 * m' * D * 4

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


def v4_kv_formula(cfg, dtype, kv_cache_dtype: str, env) -> dict:
    """The formula's figures from the config and the engine's knobs `env` (the ring size S):
    {group: (B per token, B per request, text)}, plus "state" (compressor state per request)."""
    from deepinfer.worker.model_runner import ring_size

    def row(elements: int) -> int:
        return row_format(elements, dtype, kv_cache_dtype).bytes_per_row

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    m, m_hca = cfg.compress_rates[csa], cfg.compress_rates[hca]
    n_layers, n_csa, n_hca = len(cfg.layer_types), cfg.layer_types.count(csa), cfg.layer_types.count(hca)
    d, d_index, s = cfg.head_dim, cfg.index_head_dim, ring_size(cfg.sliding_window, env)
    latent, index = row(d), row(d_index)
    out = {"swa": (0.0, n_layers * s * latent, f"{n_layers} layers x S {s} x {latent} B")}
    if n_csa:
        out["csa"] = (n_csa * latent / m, 0, f"{n_csa} x {latent} B / {m}")
        out["index"] = (n_csa * index / m, 0, f"{n_csa} x {index} B / {m}")
    if n_hca:
        out["hca"] = (n_hca * latent / m_hca, 0, f"{n_hca} x {latent} B / {m_hca}")
    state = n_csa * 6 * m * (d + d_index) * 4 + n_hca * 2 * m_hca * d * 4
    out["state"] = (0.0, state, f"{n_csa} x 6 x {m} x ({d} + {d_index}) x 4 B + {n_hca} x 2 x {m_hca} x {d} x 4 B")
    return out


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
    from deepinfer.entrypoints.info import fmt_bytes, group_bytes

    engine, runner = llm.engine, llm.engine.runner
    cfg = engine.source.hf_config
    if not has_compressed_groups(runner) or not hasattr(cfg, "compress_rates"):
        return []
    kv_dtype = engine.config.cache.kv_cache_dtype
    formula = v4_kv_formula(cfg, runner.dtype, kv_dtype, runner.env)
    lines, total_token, total_request = [], 0.0, 0
    for g in group_bytes(runner):
        want_token, want_request, text = formula.get(g.name, (None, None, "?"))
        ok = "ok" if (g.per_token, g.per_request) == (want_token, want_request) else "MISMATCH"
        what = (f"{fmt_bytes(g.per_request)} B per request, fixed" if g.kind == "ring" else
                f"{fmt_bytes(g.per_token)} B per token")
        want = (f"{fmt_bytes(want_request)} B" if g.kind == "ring" else f"{fmt_bytes(want_token)} B") \
            if want_token is not None else "none"
        shape = (f"ring of S = {g.rows_per_unit} rows per layer" if g.kind == "ring" else
                 f"1 row per {g.compress_ratio} tokens")
        lines.append(f"kv       {g.name:6s} {g.kind:5s} {g.num_layers} layers, rows of {g.row_bytes:,} B, {shape}: "
                     f"engine {what}; formula {text} = {want} [{ok}]")
        total_token += g.per_token
        total_request += g.per_request
    state, (_, want_state, text) = runner.state_bytes(), formula["state"]
    lines.append(f"kv       state  fp32 compressor state: engine {state:,} B per request; formula {text} = "
                 f"{want_state:,} B [{'ok' if state == want_state else 'MISMATCH'}]")
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
    from deepinfer.entrypoints.bench.workloads.long import allocated_bytes_per_request
    from deepinfer.entrypoints.info import fmt_bytes

    lengths = [len(p) + o for p, o in zip(workload.prompts, workload.output_lens, strict=True)]
    allocated = sum(allocated_bytes_per_request(runner, n) + runner.state_bytes() for n in lengths)
    return (f"kv       {workload.name:6s} allocated for its {len(lengths)} requests at their final lengths "
            f"({sum(lengths):,} tokens): {allocated:,} B = {fmt_bytes(round(allocated / sum(lengths), 3))} B per token")
