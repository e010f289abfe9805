"""`deepinfer info`: what the engine built and how much its KV cache holds, per cache group.

Every group prints its own row format (`runner.caches.codec_of(group)`): DeepSeek-V4's
latent rows (head_dim wide; MXFP8: 512 e4m3 + 16 UE8M0 = 528 B) and its index keys
(index_head_dim wide) differ. A paged group with a compression ratio m holds one row per m
tokens, so a block of R rows covers R * m tokens and a layer costs row_bytes / m per token.
Models with such groups (or per-group codecs) also get per-layer lines: the fixed ring bytes and
compressor state per request, and the bytes each further token adds. Every byte figure comes from the
engine's sizing record (`runner.caches.sizing`, worker/cache_sizing.py) or its allocation; info has no formula.

With `--kv-cache-dir`, the saved cache there is listed too: its files and bytes in all and per
model folder (`worker.kv_disk.scan_kv_dir`), the folder of the model just built marked.
"""

from __future__ import annotations

from collections import Counter

from deepinfer.model_executor.layers.ops.cache_common import visible_rows
from deepinfer.model_executor.layers.quant_linear import QuantEmbedding, QuantLinear
from deepinfer.worker.kv_disk import scan_kv_dir
from deepinfer.worker.summary import packed_summary


def human_bytes(num: int) -> str:
    """1536 -> '1.5 KiB', 100 -> '100 B'."""
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _entries(n: int) -> str:
    return f"{n:,} {'entry' if n == 1 else 'entries'}"


def kv_dir_lines(directory: str, budget: int | None = None, this_model: str | None = None) -> list[str]:
    """The saved cache under `directory`: entries and bytes in all and per model folder (the
    folder named `this_model`, the first 16 hex digits of a cache identity, is marked)."""
    report = scan_kv_dir(directory)
    limit = f" of {human_bytes(budget)} (--kv-cache-dir-size)" if budget else ""
    lines = [f"kv cache dir: {report['path']}: {_entries(report['entries'])}, "
             f"{human_bytes(report['bytes'])}{limit}"]
    models = sorted(report["models"].items(), key=lambda kv: (kv[0] != this_model, -kv[1]["bytes"], kv[0]))
    for folder, entry in models:
        mark = " (this model)" if folder == this_model else ""
        lines.append(f"  model {folder}{mark}: {_entries(entry['entries'])}, {human_bytes(entry['bytes'])}")
    if this_model is not None and this_model not in report["models"]:
        lines.append(f"  model {this_model} (this model): nothing saved yet")
    return lines


def fmt_bytes(value: float) -> str:
    """1234 -> '1,234', 4.125 -> '4.125' (bytes per token may be fractional: row_bytes / m)."""
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3f}".rstrip("0")


def is_multi_format(runner) -> bool:
    """Groups of shared K = V rows or with compression ratios (DeepSeek-V4), not one K|V row kind for all."""
    return any(g.row.shared_kv or g.compress_ratio > 1 for g in runner.groups)


def allocated_state_bytes(layer) -> int:
    """Per-request state the engine allocated for one layer: one slot of each state bank bound to
    it (DeepSeek-V4's compressors; 0 for a layer without any)."""
    banks = (getattr(layer, "states", None) or {}).values()
    return sum(t[0].numel() * t.element_size() for b in banks for t in (b.kv, b.score, b.prev_a_kv, b.prev_a_score))


def request_capacity(llm) -> tuple[int, int]:
    """(requests at max_model_len that fit at once, blocks one such request takes)."""
    engine, runner = llm.engine, llm.engine.runner
    kv = engine.kv_manager
    blocks = sum(spec.num_blocks_for(engine.max_model_len) for spec in kv.paged_specs)
    limits = [runner.num_blocks // blocks] if blocks else []
    if kv.ring_specs:
        limits.append(runner.num_state_slots)
    return (min(limits) if limits else 0), blocks


def group_lines(llm) -> list[str]:
    engine, runner = llm.engine, llm.engine.runner
    max_len = engine.max_model_len
    lines = []
    for gi, g in enumerate(runner.groups):
        fmt = runner.caches.codec_of(g).format
        units, n = runner.caches.cache.num_units[gi], len(g.layer_ids)
        mib = runner.caches.cache.group_bytes(gi) / 2**20
        per_token = n * fmt.bytes_per_row
        head = (f"cache group {g.name!r} ({g.kind}, {n} layers): row {fmt.note}, "
                f"{fmt.num_elements} elements = {fmt.bytes_per_row:,} B per row "
                f"({fmt.data_bytes:,} data + {fmt.scale_bytes:,} scale)")
        if g.kind == "ring":
            body = (f"  window W={g.window}: {visible_rows(max_len, g.window)} visible rows, {g.rows_per_unit} "
                    f"allocated rows (S) per request per layer = {g.rows_per_unit * fmt.bytes_per_row:,} B per layer, "
                    f"{g.rows_per_unit * per_token:,} B per request; "
                    f"{units} state slots = {units} requests, any length ({mib:,.1f} MiB)")
        elif g.compress_ratio > 1:
            m, tokens_per_block = g.compress_ratio, g.rows_per_unit * g.compress_ratio
            body = (f"  compressed: 1 row per {m} tokens, {g.rows_per_unit} rows = {tokens_per_block:,} tokens "
                    f"per block; {fmt_bytes(per_token / m)} B per token ({fmt.bytes_per_row:,} B / {m} x {n} "
                    f"layers); blocks from the pool shared by the paged groups: {units:,} pages of "
                    f"{runner.caches.cache.allocations[gi].shape[1]:,} B ({mib:,.1f} MiB)")
        else:
            tokens = units * g.rows_per_unit
            body = (f"  {per_token:,} B per token; {units:,} blocks x {g.rows_per_unit} = {tokens:,} tokens "
                    f"= {tokens // max_len:,} requests at max_model_len {max_len} ({mib:,.1f} MiB)")
        lines += [head, body]
    return lines


def layer_lines(llm) -> list[str]:
    """Per layer: its kind, the fixed bytes per request (ring rows, compressor state) and the
    bytes per token its paged groups add."""
    runner = llm.engine.runner
    layers = runner.model.attention_layers()
    lines = []
    for i, attn in enumerate(layers):
        fixed, parts = 0, []
        for g in runner.caches.sizing.groups:  # the engine's sizing (worker/cache_sizing.py)
            if i not in g.layer_ids:
                continue
            row = g.row_bytes
            if g.is_ring:
                fixed += g.rows_per_unit * row
                parts.append(f"{g.name} {g.rows_per_unit} x {row:,} B = {g.rows_per_unit * row:,} B per request")
            else:
                parts.append(f"{g.name} {row:,} B / {g.compress_ratio} = {fmt_bytes(row / g.compress_ratio)} B "
                             f"per token")
        per_token = runner.caches.sizing.layer_per_token(i)
        state = allocated_state_bytes(attn)
        if state:
            parts.append(f"compressor state {state:,} B per request")
        kind = getattr(attn, "layer_type", None) or ("sliding" if getattr(attn, "sliding_window", None) else "full")
        lines.append(f"  layer {i} ({kind}): {fmt_bytes(per_token)} B per token + {fixed + state:,} B per request "
                     f"[{'; '.join(parts)}]")
    return lines


def multi_format_lines(llm) -> list[str]:
    engine, runner = llm.engine, llm.engine.runner
    sizing = runner.caches.sizing
    per_token, rings, state = sizing.per_token, sizing.ring_bytes, sizing.state_bytes
    requests, blocks = request_capacity(llm)
    max_len = engine.max_model_len
    return [
        "per layer (cache bytes per token, fixed bytes per request):",
        *layer_lines(llm),
        f"compressor state per request (fp32, all layers): {state:,} B",
        f"KV bytes per token, all layers: {fmt_bytes(per_token)} B (paged rows, growing) + "
        f"{rings + state:,} B per request (rings {rings:,} + state {state:,}) "
        f"({kv_memory(runner.caches.cache)})",
        f"capacity: {requests:,} requests at max_model_len {max_len} at once ({blocks} blocks of the shared pool "
        f"of {runner.num_blocks:,}, {runner.num_state_slots} state slots)",
    ]


def kv_memory(cache) -> str:
    """Reserved (address space the cache may fill) and resident (pages written so far) KV bytes."""
    resident = cache.resident_bytes
    now = "" if resident is None else f", resident now: {resident / 2**20:,.1f} MiB"
    return f"reserved: {cache.num_bytes / 2**20:,.1f} MiB{now}"


def info_lines(llm) -> list[str]:
    engine = llm.engine
    cfg, runner = engine.source.hf_config, engine.runner
    layers = runner.model.attention_layers()
    load_format = engine.source.load_format
    lines = [
        f"model: {engine.source.path}" + (f" (dummy weights: {_dummy_kind(runner.model)})" if load_format == "dummy"
                                          else ""),
        f"architecture: {cfg.model_type} ({', '.join(cfg.architectures or [])})",
        f"layers: {len(layers)}, hidden: {cfg.hidden_size}, heads: {layers[0].num_heads}, "
        f"kv heads: {layers[0].num_kv_heads}, head dim: {layers[0].head_dim}, vocab: {cfg.vocab_size}",
        f"dtype: {runner.dtype}, kv cache dtype: {engine.config.cache.kv_cache_dtype}, device: {runner.device}, "
        f"max_model_len: {engine.max_model_len}, max_num_seqs: {engine.config.scheduler.max_num_seqs}",
        *weight_lines(runner, engine.source),
        *group_lines(llm),
    ]
    if is_multi_format(runner):
        lines += multi_format_lines(llm)
    else:
        lines.append(f"KV bytes per token, all layers: {runner.caches.codec.format.bytes_per_row * len(layers):,} B "
                     f"({kv_memory(runner.caches.cache)})")
    return lines + prefix_cache_lines(llm)


def _dummy_kind(model) -> str:
    """How a dummy model holds its weights: values, or shapes only (meta tensors)."""
    meta = any(p.is_meta for p in model.parameters())
    return "shapes only, no values" if meta else "seeded random values"


def weight_lines(runner, source=None) -> list[str]:
    """What `--dtype` and `--quantization` resolved to and why, and the weights' formats and bytes:
    the packed matrices beside the file's bytes for them (`packed_summary`)."""
    lines = [f"dtype choice: {runner.dtype_choice.value} ({runner.dtype_choice.reason})",
             f"quantization: {runner.quantization.value} ({runner.quantization.reason})"]
    packed = packed_summary(runner.model, source)
    if packed:
        lines.append(f"  quantized matrices: {packed}")
        levels = Counter(m.act_levels for m in runner.model.modules() if isinstance(m, QuantLinear | QuantEmbedding))
        if levels:
            lines.append("  int8 activation levels (CPU): " + ", ".join(
                f"{levels[n]} module{'s' * (levels[n] > 1)} at {n}" for n in sorted(levels, reverse=True)))
    dense = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    lines.append(f"  dense parameters: {dense / 2**20:,.1f} MiB")
    return lines


def prefix_cache_lines(llm) -> list[str]:
    """Whether prefix caching is on and, with a cache directory, what it holds."""
    engine = llm.engine
    cache = engine.config.cache
    caching = engine.kv_manager.caching
    lines = [f"prefix caching: {'on' if caching else 'off'}"
             + ("" if caching or not cache.enable_prefix_caching else " (this model has no snapshot slots)")]
    if cache.kv_cache_dir:
        identity = engine.runner.cache_identity
        lines += kv_dir_lines(cache.kv_cache_dir, cache.kv_cache_dir_size, identity[:16] if identity else None)
    return lines


def print_info(llm) -> None:
    print("\n".join(info_lines(llm)))
