"""`deepinfer info`: what the engine built and how much its KV cache holds, per cache group."""

from __future__ import annotations

from deepinfer.model_executor.layers.ops.cache_common import visible_rows


def group_lines(llm) -> list[str]:
    engine, runner = llm.engine, llm.engine.runner
    fmt, max_len = runner.codec.format, engine.max_model_len
    lines = []
    for gi, g in enumerate(runner.groups):
        units = runner.cache.num_units[gi]
        per_token = len(g.layer_ids) * fmt.bytes_per_row
        head = (f"cache group {g.name!r} ({g.kind}, {len(g.layer_ids)} layers): row {fmt.note}, "
                f"{fmt.num_elements} elements = {fmt.bytes_per_row:,} B per row "
                f"({fmt.data_bytes:,} data + {fmt.scale_bytes:,} scale)")
        if g.kind == "ring":
            body = (f"  window W={g.window}: {visible_rows(max_len, g.window)} visible rows, {g.rows_per_unit} "
                    f"allocated rows (S) per request per layer = {g.rows_per_unit * per_token:,} B per request; "
                    f"{units} state slots = {units} requests, any length "
                    f"({runner.cache.group_bytes(gi) / 2**20:,.1f} MiB)")
        else:
            tokens = units * g.rows_per_unit
            body = (f"  {per_token:,} B per token; {units:,} blocks x {g.rows_per_unit} = {tokens:,} tokens "
                    f"= {tokens // max_len:,} requests at max_model_len {max_len} "
                    f"({runner.cache.group_bytes(gi) / 2**20:,.1f} MiB)")
        lines += [head, body]
    return lines


def info_lines(llm) -> list[str]:
    engine = llm.engine
    cfg, runner = engine.source.hf_config, engine.runner
    layers = runner.model.attention_layers()
    return [
        f"model: {engine.source.path}",
        f"architecture: {cfg.model_type} ({', '.join(getattr(cfg, 'architectures', None) or [])})",
        f"layers: {len(layers)}, hidden: {cfg.hidden_size}, heads: {layers[0].num_heads}, "
        f"kv heads: {layers[0].num_kv_heads}, head dim: {layers[0].head_dim}, vocab: {cfg.vocab_size}",
        f"dtype: {runner.dtype}, kv cache dtype: {engine.config.cache.kv_cache_dtype}, device: {runner.device}, "
        f"max_model_len: {engine.max_model_len}, max_num_seqs: {engine.config.scheduler.max_num_seqs}",
        *group_lines(llm),
        f"KV bytes per token, all layers: {runner.codec.format.bytes_per_row * len(layers):,} B "
        f"(allocated: {runner.cache.num_bytes / 2**20:,.1f} MiB)",
    ]


def print_info(llm) -> None:
    print("\n".join(info_lines(llm)))
