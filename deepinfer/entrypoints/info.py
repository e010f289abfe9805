"""`deepinfer info`: what the engine built and how much the KV cache holds."""

from __future__ import annotations


def info_lines(llm) -> list[str]:
    engine = llm.engine
    cfg, runner = engine.source.hf_config, engine.runner
    shape, block_size = runner.cache_shape, engine.config.cache.block_size
    per_token = shape.bytes_per_token(runner.dtype)
    capacity = runner.num_blocks * block_size
    return [
        f"model: {engine.source.path}",
        f"architecture: {cfg.model_type} ({', '.join(getattr(cfg, 'architectures', None) or [])})",
        f"layers: {cfg.num_hidden_layers}, hidden: {cfg.hidden_size}, heads: {cfg.num_attention_heads}, "
        f"kv heads: {shape.num_kv_heads}, head dim: {shape.head_dim}, vocab: {cfg.vocab_size}",
        f"dtype: {runner.dtype}, device: {runner.device}, max_model_len: {engine.max_model_len}",
        f"cache group 'full' (paged): row = K+V of {shape.num_kv_heads} kv heads x {shape.head_dim} "
        f"= {shape.row_elements} elements = {shape.row_elements * runner.dtype.itemsize} B per layer per token",
        f"KV bytes per token (all {shape.num_layers} layers): {per_token:,} B",
        f"cache: {runner.num_blocks:,} blocks x {block_size} tokens = {capacity:,} tokens "
        f"({runner.cache.num_bytes / 2**20:,.1f} MiB), "
        f"{capacity // engine.max_model_len:,} requests at max_model_len",
    ]


def print_info(llm) -> None:
    print("\n".join(info_lines(llm)))
