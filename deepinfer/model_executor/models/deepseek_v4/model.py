"""DeepSeek-V4 for causal LM: hyper-connected decoder layers over the engine's caches.

    streams  = embed(ids) copied to hc_mult streams                     [T, N, hidden]
    per layer:
        x, post, comb = attn_hc(streams);  streams = merge(attention(norm(x)), streams, post, comb)
        x, post, comb = ffn_hc(streams);   streams = merge(moe(norm(x), ids), streams, post, comb)
    hidden   = norm(hc_head(streams))                                   [T, hidden]

Cache groups (see `cache_groups`): "swa" (ring, every layer, one latent row per token),
"csa" / "hca" (paged, one compressed row per m / m' tokens) and "index" (paged, the CSA
indexer's keys, one per m tokens). Compressor state lives in the ring's state slots.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.contracts.model import BoundCaches
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.deepseek_v4.cached_attn import CachedV4Attention
from deepinfer.model_executor.models.deepseek_v4.compressor import CSA, HCA
from deepinfer.model_executor.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead, expand_streams
from deepinfer.model_executor.models.deepseek_v4.moe import DeepseekV4MoE
from deepinfer.model_executor.models.deepseek_v4.names import expert_target, module_name
from deepinfer.model_executor.models.deepseek_v4.state_bank import StateBank
from deepinfer.model_executor.models.deepseek_v4.weights import dequantize_v4_weights


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.self_attn = CachedV4Attention(cfg, layer_idx)
        self.mlp = DeepseekV4MoE(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, N, hidden] -> [T, N, hidden]."""
        x, post, comb = self.attn_hc(streams)  # [T, hidden], [T, N], [T, N, N]
        streams = self.attn_hc.merge(self.self_attn(self.input_layernorm(x), positions), streams, post, comb)
        x, post, comb = self.ffn_hc(streams)
        return self.ffn_hc.merge(self.mlp(self.post_attention_layernorm(x), input_ids), streams, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead.from_config(cfg)

    def forward_streams(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual streams after the last layer, before the head's collapse: [T, N, hidden]
        (what the MTP module reads as the previous hidden state)."""
        streams = expand_streams(self.embed_tokens(input_ids), self.hc_mult)  # [T, N, hidden]
        for layer in self.layers:
            streams = layer(streams, positions, input_ids)
        return streams

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(self.forward_streams(input_ids, positions)))  # [T, hidden]


class DeepseekV4ForCausalLM(nn.Module):
    """forward() returns hidden states; compute_logits() runs the LM head on selected rows only."""

    def __init__(self, cfg, max_positions: int = 0):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV4Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.state_banks: list[StateBank] = []

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V]

    def attention_layers(self) -> list[CachedV4Attention]:
        return [layer.self_attn for layer in self.model.layers]

    # ---- caches ----------------------------------------------------------------------------
    def cache_groups(self) -> list[CacheGroupSpec]:
        """The window ring (every layer), then one paged group per compressed-row kind its layers
        use: "csa" / "hca" rows (latent width) and, with CSA layers only, "index" keys."""
        cfg, layers = self.config, self.attention_layers()
        latent = RowSpec(1, cfg.head_dim, shared_kv=True, field="head_dim")
        index = RowSpec(1, cfg.index_head_dim, shared_kv=True, field="index_head_dim")
        groups = [CacheGroupSpec("swa", RING, tuple(range(len(layers))), window=cfg.sliding_window, row=latent)]
        for name, kind, row in (("csa", CSA, latent), ("hca", HCA, latent), ("index", CSA, index)):
            ids = tuple(i for i, a in enumerate(layers) if a.layer_type == kind)
            if ids:
                groups.append(CacheGroupSpec(name, PAGED, ids, compress_ratio=cfg.compress_rates[kind], row=row))
        return groups

    def bind_caches(self, caches: BoundCaches) -> None:
        """Give each layer its cache views, the metadata index of each group it uses, and its
        compressor state banks (one state per ring state slot)."""
        views = {g.name: caches.layer_caches[gi] for gi, g in enumerate(caches.groups)}
        device = next(iter(views["swa"].values())).rows2d.device
        self.state_banks = []
        for i, attn in enumerate(self.attention_layers()):
            attn.window_cache, attn.window_group = views["swa"][i], caches.group_index("swa")
            if attn.compressor is None:
                continue
            rows = "csa" if attn.layer_type == CSA else "hca"
            attn.rows_cache, attn.rows_group = views[rows][i], caches.group_index(rows)
            attn.states = {"rows": StateBank(attn.compressor.init_state(device), caches.num_state_slots)}
            if attn.layer_type == CSA:
                attn.index_cache, attn.index_group = views["index"][i], caches.group_index("index")
                attn.states["index"] = StateBank(attn.compressor.indexer.init_state(device), caches.num_state_slots)
            self.state_banks += attn.states.values()

    def state_bytes_per_slot(self) -> int:
        """fp32 compressor state one request holds across all layers."""
        total = 0
        for attn in self.attention_layers():
            if attn.compressor is not None:
                total += StateBank.bytes_per_slot(attn.compressor.init_state())
                if attn.layer_type == CSA:
                    total += StateBank.bytes_per_slot(attn.compressor.indexer.init_state())
        return total

    # ---- weights ---------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """V4- or module-named tensors; FP8 / FP4 weights with their scales are dequantized.
        MTP tensors (`mtp.*`) belong to the draft module and are skipped here."""
        loaded = load_v4_weights(self, (nt for nt in dequantize_v4_weights(weights, torch.float32)
                                        if not is_mtp_name(nt[0])))
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")


def is_mtp_name(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp."))


def load_v4_weights(module: nn.Module, weights, rename=module_name) -> set[str]:
    """Copy (name, tensor) pairs into `module`; returns the parameter names loaded.

    Per-expert matrices go into the stacked expert weights; a shared expert's gate / up go into
    its merged gate_up projection.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        expert = expert_target(name)
        if expert is not None:
            owner = rename(expert[0])
            module.get_submodule(owner).load_expert_weight(expert[1], expert[2], tensor)
            loaded.add(f"{owner}.{'down_proj' if expert[2] in ('w2', 'down_proj') else 'gate_up_proj'}")
            continue
        target = rename(name)
        shared = _SHARED_GATE_UP.match(target)
        if shared:
            target = f"{shared.group(1)}.gate_up_proj.weight"
            half = params[target].shape[0] // 2
            dst = params[target].data[:half] if shared.group(2) == "gate" else params[target].data[half:]
        elif target in params:
            dst = params[target].data
        else:
            raise ValueError(f"checkpoint tensor {name!r} ({target!r}) has no matching parameter")
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add(target)
    return loaded


_SHARED_GATE_UP = re.compile(r"^(.*\.shared_experts)\.(gate|up)_proj\.weight$")


__all__ = ["DeepseekV4ForCausalLM"]
