"""DeepSeek-V4 for causal LM: hyper-connected decoder layers over the engine's caches.

    streams  = embed(ids) copied to hc_mult streams                     [T, N, hidden]
    per layer:
        x, post, comb = attn_hc(streams);  streams = merge(attention(norm(x)), streams, post, comb)
        x, post, comb = ffn_hc(streams);   streams = merge(moe(norm(x), ids), streams, post, comb)
    hidden   = norm(hc_head(streams))                                   [T, hidden]

Cache groups (see `cache_groups`): "swa" (ring, every layer, one latent row per token),
"csa" / "hca" (paged, one compressed row per m / m' tokens) and "index" (paged, the CSA
indexer's keys, one per m tokens). Compressor state lives in the ring's state slots. With the
MTP draft module on (`add_mtp`), an "mtp" ring holds its blocks' window rows.

Tensor parallelism (n ranks) splits each attention layer's heads (attn.py) and, with
expert_parallel_size ep, the routed experts (moe.py): two all_reduces per layer. The embedding,
the hyper-connections, the norms, the compressors, the indexer, the caches and the LM head are
held whole on every rank. Each rank reads only its slices and its experts from the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.contracts.model import BoundCaches, ModelCapabilities
from deepinfer.model_executor.layers.kernel_set import KernelSet
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.models.deepseek_v4.cached_attn import CachedV4Attention
from deepinfer.model_executor.models.deepseek_v4.compressor import CSA, HCA
from deepinfer.model_executor.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead, expand_streams
from deepinfer.model_executor.models.deepseek_v4.moe import DeepseekV4MoE
from deepinfer.model_executor.models.deepseek_v4.mtp import DeepseekV4MTP, num_mtp_layers
from deepinfer.model_executor.models.deepseek_v4.state_bank import StateBank
from deepinfer.model_executor.models.deepseek_v4.weights import (
    dequantize_v4_weights,
    is_mtp_name,
    load_v4_weights,
    owned_tensors,
)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, expert_parallel_size: int = 1):
        super().__init__()
        self.self_attn = CachedV4Attention(cfg, layer_idx)
        self.mlp = DeepseekV4MoE(cfg, layer_idx, expert_parallel_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, N, hidden] -> [T, N, hidden]."""
        fixed = self.attn_hc.batch_invariant  # DEEPINFER_BATCH_INVARIANT: mix in a fixed order
        x, post, comb = self.attn_hc(streams)  # [T, hidden], [T, N], [T, N, N]
        streams = self.attn_hc.merge(self.self_attn(self.input_layernorm(x), positions), streams, post, comb, fixed)
        x, post, comb = self.ffn_hc(streams)
        return self.ffn_hc.merge(self.mlp(self.post_attention_layernorm(x), input_ids), streams, post, comb, fixed)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg, expert_parallel_size: int = 1):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i, expert_parallel_size)
                                    for i in range(cfg.num_hidden_layers))
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

    # heads split over tensor-parallel ranks, routed experts over expert_parallel_size rank groups;
    # next-n layers draft (`add_mtp`, reading `last_streams`); compressor state per request and
    # compressed groups: decode runs eager, never as a CUDA graph
    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True, mtp_drafting=True,
                                     drafting_streams=True)

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__()
        self.config = cfg
        self.model = DeepseekV4Model(cfg, expert_parallel_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.state_banks: list[StateBank] = []
        self.mtp: DeepseekV4MTP | None = None  # the next-n draft module, when `add_mtp` was called
        self.last_streams: torch.Tensor | None = None  # [T, N, hidden] of the last forward (with MTP)

    def add_mtp(self) -> None:
        """Build the MTP draft module (before weights are loaded): speculative_method='mtp'."""
        n = num_mtp_layers(self.config)
        if n < 1:
            raise ValueError(f"speculative_method='mtp' needs MTP layers, but the config's "
                             f"num_nextn_predict_layers is {n}; use speculative_method='ngram'")
        self.mtp = DeepseekV4MTP(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] -> hidden [T, hidden]; with MTP on, the pre-head streams are kept in `last_streams`
        (what the draft module reads next)."""
        streams = self.model.forward_streams(input_ids, positions)  # [T, N, hidden]
        if self.mtp is not None:
            self.last_streams = streams
        return self.model.norm(self.model.hc_head(streams))  # [T, hidden]

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
        if self.mtp is not None:  # the draft blocks' window rows, ids after the main layers
            ids = tuple(layer.layer_idx for layer in self.mtp.layers)
            groups.append(CacheGroupSpec("mtp", RING, ids, window=cfg.sliding_window, row=latent))
        return groups

    def bind_caches(self, caches: BoundCaches) -> None:
        """Give each layer its cache views, the metadata index of each group it uses, and its
        compressor state banks (one state per ring state slot); and the backend's kernel set
        (layers/kernel_set.py), on which the row stores, the sparse MLA decode, the indexer's scores
        and the routed experts run."""
        self._bind_kernels(caches.backend.kernels)
        self._set_batch_invariant(caches.backend.batch_invariant)
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
        if self.mtp is not None:  # the drafter's metadata holds the "mtp" group alone: index 0
            for layer in self.mtp.layers:
                layer.self_attn.window_cache = views["mtp"][layer.layer_idx]
                layer.self_attn.window_group = 0

    def _set_batch_invariant(self, on: bool) -> None:
        """DEEPINFER_BATCH_INVARIANT (the backend's flag): the decoder layers' attention (with its
        compressors and indexer), routed experts and hyper-connections, and the head's collapse,
        take their batch-invariant forms. The draft module (MTP) keeps its own."""
        for layer in self.model.layers:
            layer.self_attn.set_batch_invariant(on)
            layer.mlp.experts.batch_invariant = on
            layer.attn_hc.batch_invariant = layer.ffn_hc.batch_invariant = on
        self.model.hc_head.batch_invariant = on

    def _bind_kernels(self, kernels: KernelSet) -> None:
        """Each decoder and MTP layer's attention (with its indexer) and routed experts take `kernels`."""
        layers = list(self.model.layers) + (list(self.mtp.layers) if self.mtp is not None else [])
        for layer in layers:
            layer.self_attn.bind_kernels(kernels)
            layer.mlp.experts.kernels = kernels

    def keep_verified(self, kept: dict[int, int]) -> None:
        """Each compressor forgets the rejected tokens of the step's verification spans."""
        for attn in self.attention_layers():
            attn.keep_verified(kept)

    def begin_step(self) -> None:
        """Every compressor's state bank records what this step changes (`StateBank.begin_step`)."""
        for bank in self.state_banks:
            bank.begin_step()

    def undo_step(self) -> None:
        """Every compressor's state back to where `begin_step` found it: token counts, open
        windows and half A (the window ring's rows are the runner's, `worker/step_undo.py`)."""
        for bank in self.state_banks:
            bank.undo_step()

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of every compressor's state in `slot` (for prefix-cache snapshots)."""
        return {f"{i}.{name}": t for i, bank in enumerate(self.state_banks) for name, t in bank.export(slot).items()}

    def write_state(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Set every compressor's state in `slot` from `read_state`'s tensors."""
        for i, bank in enumerate(self.state_banks):
            prefix = f"{i}."
            bank.load(slot, {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)})

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
        MTP tensors (`mtp.*`) go to the draft module when it was added, else are skipped; with
        the module added, a checkpoint without them is refused."""
        mtp_tensors: list = []

        def main_tensors():
            for name, tensor in weights:
                if not is_mtp_name(name):
                    yield name, tensor
                elif self.mtp is not None:
                    mtp_tensors.append((name, tensor))

        owned = owned_tensors(main_tensors(), lambda owner, expert: self.get_submodule(owner).owns(expert))
        loaded = load_v4_weights(self, dequantize_v4_weights(owned, torch.float32))
        missing = {n for n, _ in self.named_parameters() if not n.startswith("mtp.")} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        if self.mtp is not None:
            if not mtp_tensors:
                raise ValueError("speculative_method='mtp' needs the checkpoint's MTP weights (mtp.* tensors), "
                                 "but it has none; use speculative_method='ngram'")
            self.mtp.load_weights(mtp_tensors)


__all__ = ["DeepseekV4ForCausalLM"]
