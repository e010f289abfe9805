"""Tiny random DeepSeek-V4 checkpoints, written by transformers (V4 checkpoint names), for engine tests."""

from __future__ import annotations

import torch

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
VOCAB, WINDOW, M_CSA, M_HCA = 512, 8, 4, 8


def tiny_v4_config(layer_types: list[str], index_n_heads: int = 8, hc_mult: int = 2, index_head_dim: int = 32):
    import transformers

    n = len(layer_types)
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=n, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=WINDOW,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=hc_mult,
        index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=3,
        compress_rates={CSA: M_CSA, HCA: M_HCA}, layer_types=layer_types,
        mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1), num_hash_layers=1,
        compress_rope_theta=1000.0, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return cfg


def make_tiny_v4(path: str, layer_types: list[str], seed: int = 0, std: float = 0.15, **overrides):
    """Random weights large enough for peaked distributions; returns the HF model (fp32, eval)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    cfg = tiny_v4_config(layer_types, **overrides)
    model = hf.DeepseekV4ForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=gen) * (std if p.dim() > 1 else 0.3))
                if name.endswith("scale") or "norm" in name:
                    p.add_(1.0)
            elif "tid2eid" in name:
                p.copy_(torch.randint(0, cfg.n_routed_experts, p.shape, generator=gen))
        for name, b in model.named_buffers():
            if "tid2eid" in name:
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model.eval()
