"""GGUF LoRA adapters: a PEFT adapter of a tiny Llama, written as llama.cpp's `convert_lora_to_gguf.py`
writes it (F32 and Q8_0), read back by `read_gguf_lora` and compared with PEFT's own safetensors."""

from __future__ import annotations

import json
import re

import gguf
import pytest
import torch
from llamacpp_writer import llama_cpp_permute, random_hf_model, tiny_hf_config
from safetensors.torch import load_file

from deepinfer.model_executor.loader.gguf_file import read_gguf_file
from deepinfer.model_executor.loader.gguf_lora import read_gguf_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
PEFT_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight")


def peft_adapter(directory, config, rank: int, rank_pattern: dict | None = None) -> str:
    """A PEFT LoRA of every linear layer with random lora_A and lora_B, saved with save_pretrained."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, rank_pattern=rank_pattern or {},
                      lora_dropout=0.0)
    model = get_peft_model(random_hf_model(config), lora)
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    model.save_pretrained(directory)
    return str(directory)


def write_gguf_lora(adapter_dir: str, path, config, outtype) -> str:
    """The adapter as llama.cpp's converter writes it: lora_a / lora_b under the base tensor's name, lora_b of
    q/k through the base's q/k row permutation (its LoraTorchTensor applies the base's reshape + swapaxes to
    B's rows), each tensor in `outtype` with the converter's F16 fallback for rows that are not whole Q8_0 blocks."""
    with open(f"{adapter_dir}/adapter_config.json") as f:
        alpha = float(json.load(f)["lora_alpha"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, tensor in sorted(load_file(f"{adapter_dir}/adapter_model.safetensors").items()):
        layer, module, part = PEFT_NAME.fullmatch(name).groups()
        data = tensor.float().numpy()  # A [r, in], B [out, r]
        if part == "B" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        qtype = outtype
        try:
            encoded = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:
            qtype = gguf.GGMLQuantizationType.F16
            encoded = gguf.quants.quantize(data, qtype)
        writer.add_tensor(f"blk.{layer}.{GGUF_PARTS[module]}.weight.lora_{part.lower()}", encoded, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def llama_config():
    return tiny_hf_config("llama")  # hidden 64, 4 heads, 2 KV heads of 16, 2 layers


def test_f32_adapter_reads_back_exactly(tmp_path, llama_config):
    adapter = peft_adapter(tmp_path / "peft", llama_config, rank=8, rank_pattern={"down_proj": 4})
    path = write_gguf_lora(adapter, tmp_path / "lora-f32.gguf", llama_config, gguf.GGMLQuantizationType.F32)
    config, tensors = read_gguf_lora(path, base_config=llama_config)
    expected = load_file(f"{adapter}/adapter_model.safetensors")
    assert sorted(tensors) == sorted(expected) and len(tensors) == 2 * 7 * 2
    for name, tensor in expected.items():
        assert tensors[name].dtype == torch.float32 and torch.equal(tensors[name], tensor), name
    with open(f"{adapter}/adapter_config.json") as f:
        peft_config = json.load(f)
    for field in ("r", "lora_alpha", "use_rslora"):
        assert config[field] == peft_config[field], field
    assert config["target_modules"] == sorted(peft_config["target_modules"])
    assert config["rank_pattern"] == {f"model.layers.{i}.mlp.down_proj": 4 for i in range(2)}


def test_q8_0_adapter_reads_back_approximately(tmp_path, llama_config):
    adapter = peft_adapter(tmp_path / "peft", llama_config, rank=32, rank_pattern={"v_proj": 16})
    path = write_gguf_lora(adapter, tmp_path / "lora-q8.gguf", llama_config, gguf.GGMLQuantizationType.Q8_0)
    types = {t.name: t.tensor_type.name for t in read_gguf_file(path).tensors}
    assert types["blk.0.attn_q.weight.lora_b"] == "Q8_0"  # the permuted rows, quantized
    assert types["blk.1.attn_v.weight.lora_b"] == "F16"  # rank 16: rows of 16 values, the converter's fallback
    _, tensors = read_gguf_lora(path, base_config=llama_config.to_dict())
    for name, tensor in load_file(f"{adapter}/adapter_model.safetensors").items():
        got = tensors[name]
        assert got.shape == tensor.shape, name
        # Q8_0: 32 values share a scale d = amax / 127 stored as fp16 (relative error 2^-11), so a value is off
        # by at most d / 2 (its rounding) + 127 * d * 2^-11 (the scale's): amax * (1/254 + 2^-11); F16 far less
        blocks = min(32, tensor.shape[-1])
        bound = tensor.abs().unflatten(-1, (-1, blocks)).amax(-1, keepdim=True) * (1 / 254 + 2**-11)
        assert ((got - tensor).abs().unflatten(-1, (-1, blocks)) <= bound).all(), name
        if types[_gguf_name(name)] == "Q8_0":
            assert not torch.equal(got, tensor), name  # the quantized path was taken


def _gguf_name(peft_name: str) -> str:
    layer, module, part = PEFT_NAME.fullmatch(peft_name).groups()
    return f"blk.{layer}.{GGUF_PARTS[module]}.weight.lora_{part.lower()}"


def test_the_file_delta_is_the_permuted_delta(tmp_path, llama_config):
    """What llama.cpp computes with the file (B_file A_file added to its q/k-permuted base) is the permuted
    PEFT delta: the converter's B permutation is the base's, so undoing it per head is right."""
    adapter = peft_adapter(tmp_path / "peft", llama_config, rank=8)
    path = write_gguf_lora(adapter, tmp_path / "lora.gguf", llama_config, gguf.GGMLQuantizationType.F32)
    file = {t.name: torch.from_numpy(t.data.copy()) for t in read_gguf_file(path).tensors}
    peft = load_file(f"{adapter}/adapter_model.safetensors")
    _, ours = read_gguf_lora(path, base_config=llama_config)
    for part, module, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
        stem = f"base_model.model.model.layers.1.self_attn.{module}"
        delta_hf = peft[f"{stem}.lora_B.weight"].double() @ peft[f"{stem}.lora_A.weight"].double()  # [out, in]
        delta_file = file[f"blk.1.{part}.weight.lora_b"].double() @ file[f"blk.1.{part}.weight.lora_a"].double()
        assert torch.equal(delta_file, torch.from_numpy(llama_cpp_permute(delta_hf.numpy(), heads)))
        assert not torch.equal(delta_file, delta_hf)  # the interleave is live at these heads
        delta_ours = ours[f"{stem}.lora_B.weight"].double() @ ours[f"{stem}.lora_A.weight"].double()
        assert torch.equal(delta_ours, delta_hf)


def test_bad_files_are_refused(tmp_path, llama_config):
    adapter = peft_adapter(tmp_path / "peft", llama_config, rank=4)
    path = write_gguf_lora(adapter, tmp_path / "lora.gguf", llama_config, gguf.GGMLQuantizationType.F32)
    with pytest.raises(ValueError, match="needs the base model's num_key_value_heads"):
        read_gguf_lora(path)
    cases = {
        "model": ({"general.type": "model"}, {}),
        "embedding": ({}, {"token_embd.weight.lora_a": (4, 64), "token_embd.weight.lora_b": (64, 4)}),
        "lone": ({}, {"blk.0.attn_v.weight.lora_b": (32, 4)}),
        "norm": ({}, {"blk.0.attn_norm.weight": (64,)}),
    }
    messages = {"model": "is not a GGUF LoRA adapter", "embedding": "not the lora_a / lora_b matrix",
                "lone": "lora_b without its lora_a", "norm": "not the lora_a / lora_b matrix"}
    for case, (metadata, shapes) in cases.items():
        writer = gguf.GGUFWriter(str(tmp_path / f"{case}.gguf"), "llama")
        writer.add_type(metadata.get("general.type", gguf.GGUFType.ADAPTER))
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        for name, shape in shapes.items():
            writer.add_tensor(name, torch.randn(shape).numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=messages[case]):
            read_gguf_lora(str(tmp_path / f"{case}.gguf"), base_config=llama_config)


def test_without_alpha_the_scale_is_one(tmp_path, llama_config):
    """llama.cpp scales by 1 when adapter.lora.alpha is 0 or absent: the config says alpha = rank per module."""
    writer = gguf.GGUFWriter(str(tmp_path / "no-alpha.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    for layer, part, rank in ((0, "attn_v", 4), (1, "attn_v", 4), (0, "attn_output", 8)):
        rows = 32 if part == "attn_v" else 64
        writer.add_tensor(f"blk.{layer}.{part}.weight.lora_a", torch.randn(rank, 64).numpy())
        writer.add_tensor(f"blk.{layer}.{part}.weight.lora_b", torch.randn(rows, rank).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, tensors = read_gguf_lora(str(tmp_path / "no-alpha.gguf"))  # no q/k: no head counts needed
    assert config["r"] == 4 and config["lora_alpha"] == 4.0 and config["target_modules"] == ["o_proj", "v_proj"]
    assert config["rank_pattern"] == {"model.layers.0.self_attn.o_proj": 8}
    assert config["alpha_pattern"] == {"model.layers.0.self_attn.o_proj": 8.0}
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"].shape == (64, 8)
