"""Tiny random HF checkpoints for parity tests, and the teacher-forcing reference."""

from __future__ import annotations

import os
import shutil

import torch

VOCAB = 49152  # the default model's tokenizer

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def tiny_config(arch: str, **overrides):
    import transformers as tf

    if arch == "llama":
        cfg = tf.LlamaConfig(**_COMMON, rope_theta=10000.0)
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**{**_COMMON, "max_position_embeddings": 4096}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0})
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**_COMMON, use_sliding_window=False)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**_COMMON, head_dim=32, use_sliding_window=False)
    elif arch == "mistral":
        cfg = tf.MistralConfig(**_COMMON, sliding_window=None)
    elif arch == "mistral_swa":  # every layer slides
        cfg = tf.MistralConfig(**_COMMON, sliding_window=16)
    elif arch == "qwen2_swa":  # layers >= max_window_layers slide: layer 0 global, layer 1 local
        cfg = tf.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    elif arch == "gemma3":  # local, local, global, local, local; linear-scaled global RoPE as in 4B+
        cfg = tf.Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 5, "rms_norm_eps": 1e-6,
                                     "tie_word_embeddings": True}, head_dim=32, sliding_window=16,
                                  query_pre_attn_scalar=24, final_logit_softcapping=10.0,
                                  layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                  + ["sliding_attention"] * 2,
                                  rope_parameters={
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1000000.0}})
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def make_tiny_checkpoint(arch: str, path: str, tokenizer_dir: str, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):  # tokenizer files and the chat template
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))


def hf_reference(model_dir: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.no_grad()
def teacher_forcing_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """log_softmax rows of a full causal forward (no cache) that predict each output token.

    Returns [len(output_ids), V]: row i is the distribution the model gives output_ids[i].
    """
    ids = torch.tensor([prompt_ids + output_ids[:-1]])  # [1, L]
    logits = hf_model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[len(prompt_ids) - 1:], dim=-1)  # [n_out, V]


def assert_teacher_forcing(hf_model, prompt_ids, output_ids, sampled_logprobs=None, atol=1e-3):
    """Each output token is the argmax of the reference at its position; logprobs match."""
    ref = teacher_forcing_logprobs(hf_model, prompt_ids, output_ids)  # [n, V]
    for i, token in enumerate(output_ids):
        best = ref[i].max()
        # a tie within float noise may pick either token
        assert ref[i, token] >= best - 1e-4, (i, token, int(ref[i].argmax()), float(best - ref[i, token]))
        if sampled_logprobs is not None:
            assert abs(sampled_logprobs[i] - float(ref[i, token])) < atol, (i, sampled_logprobs[i],
                                                                            float(ref[i, token]))


@torch.inference_mode()
def run_steps(llm, steps) -> list[torch.Tensor]:
    """Logits [T, V] of every row of each single-request step (ScheduledRequests), run in order
    through the engine's own cache and runner metadata."""
    from deepinfer.contracts.plan import StepPlan
    from deepinfer.model_executor.forward_context import forward_context
    from deepinfer.worker.input_batch import build_step_inputs

    runner, out = llm.engine.runner, []
    for step in steps:
        inputs = build_step_inputs(StepPlan([step]), runner.caches.addressing, runner.device)
        with forward_context(inputs.attn_metadata):
            hidden = runner.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        out.append(runner.model.compute_logits(hidden).float())  # [T, V]
    return out
