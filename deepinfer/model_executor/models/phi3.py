"""Phi-3 / Phi-4 (HF `phi3`): the Llama family's decoder (llama.py) with Phi's checkpoint and RoPE.

    weights     the checkpoint's fused `qkv_proj` (q | k | v rows) and `gate_up_proj` (gate | up)
                are cut into their pieces as they load (`FusedPiece`), so each tensor-parallel rank
                reads only its own q, k, v (and gate, up) rows, dense, lazy or kept quantized
    RoPE        default or LongRoPE (`rope_type` "longrope": short_factor / long_factor per
                frequency, original_max_position_embeddings), from transformers' rope functions;
                partial rotary (`partial_rotary_factor`, Phi-4-mini): the first R dims rotate
    window      `sliding_window` (Phi-3-mini: 2047) on every layer, in rings

LongRoPE's factor set. transformers 5.24 (`dynamic_rope_update` -> `longrope_frequency_update`)
picks one set per forward call from the call's largest position: max(position_ids) + 1 >
original_max_position_embeddings gives the long factors to every position of that call, else the
short ones; its `generate` drops the cache and recomputes the whole sequence with the long set when
a sequence first grows past the original length. Cached keys here keep the rotation they were
stored with, so the set is fixed per engine from `max_model_len` (the model's `max_positions`, resolved
before the model is built: worker/context_length.py):

    max_model_len <= original   short factors: HF's set for every request the engine can run
    max_model_len >  original   long factors at every position of every request: HF's set for a
                                sequence longer than the original length; a request that stays
                                within it gets the long set where HF would use the short one

Both sets share the attention factor that scales cos and sin (HF: `attention_factor`, by default
sqrt(1 + ln(max_position_embeddings / original) / ln(original))).
"""

from __future__ import annotations

import torch

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.rotary import RotaryEmbedding, rope_inv_freq
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec
from deepinfer.model_executor.models.llama import llama_spec

_ROPE_TYPES = ("default", "longrope")


def check_phi3_config(cfg) -> None:
    """Refuse the options this model does not implement, naming the field and value."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported; expected silu")
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_parameters['rope_type']={rope_type!r} is not supported; expected one of {_ROPE_TYPES}")
    if rope_type == "longrope" and "original_max_position_embeddings" not in cfg.rope_parameters:
        raise ValueError("rope_parameters needs original_max_position_embeddings for rope_type 'longrope'")


def longrope_seq_len(cfg, max_positions: int) -> int | None:
    """The length LongRoPE's factor set is chosen for (module docstring): past the original length
    when the engine's max_positions is, else None (the short set)."""
    original = int(cfg.rope_parameters["original_max_position_embeddings"])
    return original + 1 if max_positions > original else None


def phi3_rotaries(spec: DecoderSpec, cfg, max_positions: int) -> list[RotaryEmbedding]:
    """The RoPE every layer shares: R = head_dim * partial_rotary_factor rotating dims."""
    params, head_dim = cfg.rope_parameters, spec.head_dim
    if params.get("rope_type", "default") == "longrope":  # transformers applies the partial factor
        inv_freq, scaling = rope_inv_freq(cfg, head_dim, seq_len=longrope_seq_len(cfg, max_positions))
    else:
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, scaling = rope_inv_freq(cfg, rotary_dim)
    return [RotaryEmbedding(inv_freq, max_positions, scaling)] * cfg.num_hidden_layers


class FusedPiece:
    """Rows [start, start + length) of a checkpoint tensor that stacks projections (a tensor, a
    QuantWeight or a lazy slice), with what `ShardSpec.read` asks of a lazy tensor (`shape`,
    `narrow`, `read`): a rank's rows of the piece are read from the source, nothing more."""

    def __init__(self, source, start: int, length: int):
        self.source, self.start = source, start
        self.shape = torch.Size((length, *source.shape[1:]))

    def narrow(self, dim: int, start: int, length: int):
        if dim == 0:
            return self.source.narrow(0, self.start + start, length)
        return self.read().narrow(dim, start, length)

    def read(self):
        return self.source.narrow(0, self.start, self.shape[0])


def split_fused(weights, cfg, head_dim: int):
    """(name, tensor) pairs with each fused `qkv_proj` / `gate_up_proj` tensor replaced by its pieces
    under the unfused names (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`), which loading
    stacks into the merged projections (models/utils.py)."""
    q_rows, kv_rows = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    fused = {".qkv_proj.": ((".q_proj.", q_rows), (".k_proj.", kv_rows), (".v_proj.", kv_rows)),
             ".gate_up_proj.": ((".gate_proj.", cfg.intermediate_size), (".up_proj.", cfg.intermediate_size))}
    for name, tensor in weights:
        part = next((p for p in fused if p in name), None)
        if part is None:
            yield name, tensor
            continue
        pieces, start = fused[part], 0
        if tensor.shape[0] != sum(rows for _, rows in pieces):
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                             f"{' + '.join(str(rows) for _, rows in pieces)}")
        for piece, rows in pieces:
            yield name.replace(part, piece), FusedPiece(tensor, start, rows)
            start += rows


class Phi3ForCausalLM(DecoderLM):
    """HF `phi3` (Phi-3 mini / medium, Phi-3.5 mini, Phi-4, Phi-4-mini): the decoder
    (models/decoder.py) with the Llama spec and Phi's RoPE; fused checkpoint tensors cut as they load."""

    # as the Llama family: CUDA-graph-safe decode, split over tensor-parallel ranks, row-independent
    # on the fp32 CPU path, quantizable at load
    capabilities = ModelCapabilities(graph_safe_decode=True, tensor_parallel=True, native_batch_invariant=True,
                                     quantize_at_load=True)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        check_phi3_config(cfg)
        return llama_spec(cfg, rotaries=phi3_rotaries)

    def load_weights(self, weights) -> None:
        super().load_weights(split_fused(weights, self.config, self.spec.head_dim))
