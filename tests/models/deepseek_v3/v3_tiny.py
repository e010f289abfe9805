"""Tiny random DeepSeek-V3 / V2 checkpoints written by transformers, for engine tests.

hidden 64, 4 heads, kv_lora_rank 32 (latent row 32 + 8 RoPE = 40 values), q_lora_rank 48, 8 routed
experts (top-2 of n_group 2 / topk_group 1), one dense first layer, weights with std 0.08.
"""

from __future__ import annotations

import torch

VOCAB = 512
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


def tiny_config(model_type: str = "deepseek_v3", **overrides):
    import transformers

    fields = {**BASE, **overrides}
    if model_type == "deepseek_v2":
        fields.setdefault("topk_method", "group_limited_greedy")
        fields.setdefault("routed_scaling_factor", 2.0)
        cfg = transformers.DeepseekV2Config(**fields)
    else:
        fields.setdefault("routed_scaling_factor", 2.5)
        cfg = transformers.DeepseekV3Config(**fields)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model, seed: int, std: float = 0.08):
    """Matrices ~ N(0, std), norm weights 1 + N(0, 0.1), the router's correction bias N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def make_tiny(path: str, model_type: str = "deepseek_v3", seed: int = 0, **overrides):
    """Save a tiny random checkpoint to `path`; returns the HF model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, **overrides)
    model = randomize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed)
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model.eval()


def hf_mtp(hf_model, seed: int = 7):
    """transformers' MTP module (`MtpModel`: enorm, hnorm, eh_proj, a decoder layer, post_norm) for
    `hf_model`, sharing its embedding and head, with random weights."""
    from transformers.modeling_layers import MtpModel

    mtp = MtpModel(hf_model, hf_model.config.num_mtp_layers).float().eval()
    randomize(mtp.layers, seed)
    return mtp


def mtp_checkpoint_tensors(mtp, num_layers: int) -> dict[str, torch.Tensor]:
    """`mtp`'s layers under DeepSeek-V3 checkpoint names (`model.layers.{num_layers + i}.*`, experts one
    matrix each, `shared_head.norm`), with the copies of the shared embedding and head DeepSeek ships."""
    out = {}
    for i, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{num_layers + i}."
        for name, t in layer.state_dict().items():
            name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            if name.endswith("experts.gate_up_proj"):
                for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up.clone()
            elif name.endswith("experts.down_proj"):
                for e, down in enumerate(t.unbind(0)):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down.clone()
            else:
                out[prefix + name] = t.clone()
        out[prefix + "embed_tokens.weight"] = mtp.embed_tokens.weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = mtp.shared_head.weight.detach().clone()
    return out


def add_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrite `path`/model.safetensors with `tensors` added."""
    import os

    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **{n: t.contiguous() for n, t in tensors.items()}}, file, metadata={"format": "pt"})
