"""DeepSeek-V3 / R1 (`deepseek_v3`) and DeepSeek-V2 / V2-Lite (`deepseek_v2`) for causal LM.

    h      = embed(ids)                                                     [T, hidden]
    layers = MLA attention (cached_attn.py) + dense MLP or MoE (moe.py): models/decoder.py's layer
    hidden = norm(h)                                                        [T, hidden]

Cache groups (`cache_groups`): "mla", paged, every layer, ONE latent row per token per layer that
serves as K and V of all heads (kv_lora_rank + qk_rope_head_dim values: 576 for V3 and V2, so
1,152 B in bf16, 576 e4m3 + 18 UE8M0 bytes = 594 B as MXFP8). With the MTP draft module on
(`add_mtp`, V3 only), an "mtp" ring group holds its layers' rows, as long as the model length.

Tensor parallelism (n ranks) splits each attention layer's heads (mla.py), the dense MLPs' and
shared experts' intermediate size and, with expert_parallel_size ep, the routed experts (moe.py):
two all_reduces per layer. The embedding, the LM head, the norms, the routers and the latent
projections are held whole on every rank, and so are the latent rows: every rank's heads read
the same row. Each rank reads only its slices and its experts from the checkpoint.

Checkpoints: HF safetensors (FP8 weights dequantized) or GGUF files of llama.cpp's `deepseek2`
architecture (loader/gguf_deepseek2.py); with quantization "gguf" a file's matrices stay in their blocks
(weights.py), the routed experts as `QuantFusedExperts`.
"""

from __future__ import annotations

import torch

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.contracts.model import BoundCaches, ModelCapabilities
from deepinfer.model_executor.layers.fused_moe import FusedExperts
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec
from deepinfer.model_executor.models.deepseek_v3.cached_attn import CachedMLAAttention
from deepinfer.model_executor.models.deepseek_v3.config import V2, check_config, is_moe_layer, num_mtp_layers
from deepinfer.model_executor.models.deepseek_v3.mla import mla_rotary
from deepinfer.model_executor.models.deepseek_v3.moe import DeepseekMoE, SplitMLP, deepseek_router
from deepinfer.model_executor.models.deepseek_v3.mtp import DeepseekMTP
from deepinfer.model_executor.models.deepseek_v3.weights import load_deepseek_weights

LATENT_FIELD = "kv_lora_rank + qk_rope_head_dim"


def deepseek_spec(cfg) -> DecoderSpec:
    """The decoder (models/decoder.py) of V2 / V3: MLA attention, a dense MLP on the first
    `first_k_dense_replace` layers and an MoE block after (the MTP layers too), one RoPE table, the
    embedding and the head held whole on every rank."""
    check_config(cfg)
    router = deepseek_router(cfg) if cfg.n_routed_experts else None

    def feed_forward(spec: DecoderSpec, cfg, layer_idx: int, expert_parallel_size: int):
        if is_moe_layer(cfg, layer_idx):
            return DeepseekMoE(cfg, router, expert_parallel_size)
        return SplitMLP(cfg.hidden_size, cfg.intermediate_size, "intermediate_size")

    return DecoderSpec(attention=lambda spec, cfg, layer_idx, rotary: CachedMLAAttention(cfg, layer_idx, rotary),
                       mlp=feed_forward, rotaries=lambda spec, cfg, max_positions:
                       [mla_rotary(cfg, max_positions)] * cfg.num_hidden_layers, vocab_split=False)


class DeepseekV3ForCausalLM(DecoderLM):
    """forward() returns hidden states; compute_logits() runs the LM head on selected rows only."""

    # heads split over tensor-parallel ranks, routed experts over expert_parallel_size rank groups;
    # next-n layers draft (`add_mtp`, reading `last_streams`); routing syncs with the host and the
    # decode index width follows the longest request: decode runs eager, never as a CUDA graph
    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True, mtp_drafting=True,
                                     drafting_streams=True)

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__(cfg, max_positions, expert_parallel_size)
        self.mtp: DeepseekMTP | None = None  # the next-n draft module, when `add_mtp` was called
        self.last_streams: torch.Tensor | None = None  # [T, 1, hidden] of the last forward (with MTP)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return deepseek_spec(cfg)

    def add_mtp(self) -> None:
        """Build the MTP draft module (before the weights load): speculative_method='mtp'."""
        n = num_mtp_layers(self.config)
        if n < 1:
            raise ValueError(f"speculative_method='mtp' needs MTP layers, but the config's "
                             f"num_nextn_predict_layers is {n}; use speculative_method='ngram'")
        self.mtp = DeepseekMTP(self.spec, self.config, self.rotaries[0], self.expert_parallel_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] -> hidden [T, hidden]; with MTP on, also kept in `last_streams` [T, 1, hidden]."""
        hidden = self.model(input_ids, positions)  # [T, hidden]
        if self.mtp is not None:
            self.last_streams = hidden[:, None]  # [T, 1, hidden]
        return hidden

    def attention_layers(self) -> list:
        return [layer.self_attn for layer in self.model.layers]

    # ---- caches (the CachedModel protocol) -------------------------------------------------
    def latent_row(self) -> RowSpec:
        """One shared K = V row per token: the normalised latent and the rotated RoPE key."""
        return RowSpec(1, self.config.kv_lora_rank + self.config.qk_rope_head_dim, shared_kv=True,
                       field=LATENT_FIELD)

    def cache_groups(self) -> list[CacheGroupSpec]:
        """"mla" (paged, every layer); with the MTP module, an "mtp" ring as long as the model
        length (its layer ids follow the main layers')."""
        row = self.latent_row()
        groups = [CacheGroupSpec("mla", PAGED, tuple(range(len(self.model.layers))), row=row)]
        if self.mtp is not None:
            ids = tuple(layer.layer_idx for layer in self.mtp.layers)
            groups.append(CacheGroupSpec("mtp", RING, ids, window=max(self.max_positions, 1), row=row))
        return groups

    def bind_caches(self, caches: BoundCaches) -> None:
        """Each layer's cache view and group index; the backend's kernel set for the row stores,
        the sparse MLA decode and the routed experts. The batch-invariant mode is refused."""
        if caches.backend.batch_invariant:
            raise ValueError(f"DEEPINFER_BATCH_INVARIANT=1 is not supported for model_type="
                             f"{self.config.model_type!r}: its MLA attention has no batch-invariant path; "
                             "unset DEEPINFER_BATCH_INVARIANT")
        kernels = caches.backend.kernels
        gi = caches.group_index("mla")
        for i, attn in enumerate(self.attention_layers()):
            attn.bind(caches.layer_caches[gi][i], gi, kernels)
        if self.mtp is not None:  # the drafter's metadata holds the "mtp" group alone: index 0
            views = caches.layer_caches[caches.group_index("mtp")]
            for layer in self.mtp.layers:
                layer.self_attn.bind(views[layer.layer_idx], 0, kernels)
        for module in self.modules():
            if isinstance(module, DeepseekMoE) and isinstance(module.experts, FusedExperts):
                module.experts.kernels = kernels  # packed experts (QuantFusedExperts) run the integer kernels

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """HF-named tensors; FP8 weights with `weight_scale_inv` are dequantized, GGUF blocks kept
        (weights.py: quantized twins of the linears, `QuantFusedExperts` once every expert matrix
        arrived packed). MTP layers load into the draft module when it was added (then a checkpoint
        without them is refused)."""
        num_mtp = len(self.mtp.layers) if self.mtp is not None else 0
        loaded = load_deepseek_weights(self, weights, self.config.num_hidden_layers, num_mtp)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing and self.mtp is not None and all(n.startswith("mtp.") for n in missing):
            raise ValueError(f"speculative_method='mtp' needs the checkpoint's MTP layers (model.layers."
                             f"{self.config.num_hidden_layers}.*), but it lacks {len(missing)} of their parameters, "
                             f"e.g. {sorted(missing)[:3]}; use speculative_method='ngram'")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for moe in [m for m in self.modules() if isinstance(m, DeepseekMoE)]:
            moe.experts = moe.experts.finish_loading()  # every held expert arrived, else the checkpoint is refused


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite: the same model with the softmax router and no MTP layers."""

    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        if cfg.model_type != V2:
            raise ValueError(f"model_type={cfg.model_type!r} is not {V2!r}")
        return deepseek_spec(cfg)


__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]
