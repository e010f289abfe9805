"""Tiny PEFT adapters over tiny random HF checkpoints, and the PEFT reference with one of them active.

`make_adapter` builds an adapter with peft (LoraConfig + get_peft_model), draws its A and B at random
(PEFT starts B at zero, which would make every adapter a no-op) and saves it with save_pretrained:
adapter_config.json + adapter_model.safetensors. `PeftReference` loads the base once with every
adapter attached (PeftModel.load_adapter) and scores a sequence with a chosen adapter active, or
with adapters disabled for the base model.
"""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, out_dir: str, r: int, targets: list[str], alpha: float = 16.0,
                 rslora: bool = False, seed: int = 0, std: float = 0.1) -> str:
    """Save a PEFT LoRA adapter of rank `r` on `targets` of the base at `base_dir` into `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


class PeftReference:
    """The base at `base_dir` with adapters {name: directory} attached (HF transformers + peft)."""

    def __init__(self, base_dir: str, adapters: dict[str, str]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)

    @torch.no_grad()
    def logprobs(self, adapter: str | None, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """[len(output_ids), V] log-softmax rows that predict each output token (teacher forcing)."""
        ids = torch.tensor([prompt_ids + output_ids[:-1]])  # [1, L]
        if adapter is None:
            with self.model.disable_adapter():
                logits = self.model(input_ids=ids, use_cache=False).logits[0]  # [L, V]
        else:
            self.model.set_adapter(adapter)
            logits = self.model(input_ids=ids, use_cache=False).logits[0]  # [L, V]
        return torch.log_softmax(logits[len(prompt_ids) - 1:].float(), dim=-1)  # [n_out, V]


def assert_matches_reference(ref: PeftReference, adapter: str | None, prompt_ids: list[int], output,
                             atol: float = 1e-4) -> float:
    """Every greedy token is the reference's argmax, and every reported top logprob equals the
    reference's within `atol`; returns the largest difference seen."""
    rows = ref.logprobs(adapter, prompt_ids, list(output.token_ids))  # [n, V]
    worst = 0.0
    for i, token in enumerate(output.token_ids):
        best = rows[i].max()
        assert rows[i, token] >= best - 1e-5, (adapter, i, token, int(rows[i].argmax()))
        for tid, lp in output.logprobs[i].items():
            worst = max(worst, abs(lp.logprob - float(rows[i, tid])))
    assert worst < atol, (adapter, worst)
    return worst


# three adapters of different ranks and targets (one rsLoRA), as the parity and server tests use them
ADAPTER_SPECS = {
    "a": dict(r=4, targets=["q_proj", "v_proj"], alpha=16.0, seed=1),
    "b": dict(r=8, targets=ALL_TARGETS, alpha=8.0, seed=2),
    "c": dict(r=16, targets=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], alpha=32.0, rslora=True,
              seed=3),
}


def make_adapters(base_dir: str, root, specs: dict | None = None) -> dict[str, str]:
    """{name: directory} of the adapters in `specs` (default ADAPTER_SPECS), saved under `root`."""
    specs = ADAPTER_SPECS if specs is None else specs
    return {name: make_adapter(base_dir, str(root / name), **spec) for name, spec in specs.items()}


def random_prompts(num: int, low: int, high: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(low, high))] for _ in range(num)]


_GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def write_gguf_adapter(adapter_dir: str, path: str, num_heads: int, num_kv_heads: int) -> str:
    """The PEFT adapter at `adapter_dir` as llama.cpp's converter writes a llama LoRA (F32): lora_a /
    lora_b under the base tensor's name, alpha in the metadata, lora_b of q/k in llama.cpp's row order."""
    import json
    import re

    import gguf
    from llamacpp_writer import llama_cpp_permute
    from safetensors.torch import load_file

    with open(f"{adapter_dir}/adapter_config.json") as f:
        alpha = float(json.load(f)["lora_alpha"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    pattern = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")
    for name, tensor in sorted(load_file(f"{adapter_dir}/adapter_model.safetensors").items()):
        layer, module, part = pattern.fullmatch(name).groups()
        data = tensor.float().numpy()  # A [r, in], B [out, r]
        if part == "B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            data = llama_cpp_permute(data, num_heads if module == "self_attn.q_proj" else num_kv_heads)
        writer.add_tensor(f"blk.{layer}.{_GGUF_PARTS[module]}.weight.lora_{part.lower()}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
