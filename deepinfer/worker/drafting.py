"""The worker's side of speculative decoding: the drafter of `config.method` built over the worker's
parts. The drafters themselves live in `spec_decode/` (which may not import the worker); what their
passes need of the worker is handed in here:

    ngram        NgramDrafter: nothing (prompt lookup over the request's history)
    mtp          MtpDrafter + a pass-metadata builder over the model's "mtp" ring group
    draft_model  DraftModelDrafter + the draft's cache (`worker/draft_cache.py`: an allocation of
                 the worker's, at the target's units), which builds its passes' metadata

Pass metadata is the worker's `input_batch.PassMetadata` (one-request spans -> AttentionMetadata
over the given groups' addressing, on the model's device).
"""

from __future__ import annotations

import os

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.drafting import Drafter
from deepinfer.model_executor.loader.gguf_file import gguf_parts
from deepinfer.spec_decode.draft_length import DraftLength
from deepinfer.spec_decode.draft_model import DraftModelDrafter
from deepinfer.spec_decode.drafter import NgramDrafter
from deepinfer.spec_decode.mtp import MtpDrafter
from deepinfer.worker.draft_cache import DraftCache
from deepinfer.worker.input_batch import PassMetadata


def make_drafter(config: SpeculativeConfig, model, addressing: list, device: torch.device,
                 draft: DraftCache | None = None, vocab_size: int = 0, max_model_len: int = 0,
                 target_path: str | None = None, hf_config=None) -> Drafter | None:
    """The drafter of `config.method` (None without one); "mtp" drafts over the "mtp" group of
    `addressing`; "draft_model" drafts with `draft`'s model ids below `vocab_size` (the target's), at
    positions below `max_model_len`. `target_path` and `hf_config` (the model's checkpoint and config)
    price a draft pass for the adaptive length."""
    if config.method is None:
        return None
    if config.method == "ngram":
        return NgramDrafter(config, draft_length(config, 0.0, sunk=False))
    if config.method == "draft_model":
        if draft is None:
            raise ValueError("speculative_method='draft_model' needs speculative_model (a draft checkpoint)")
        cost = draft_model_cost(config.model, target_path)
        return DraftModelDrafter(config, draft, vocab_size, max_model_len, draft_length(config, cost, sunk=True))
    mtp = [a for a in addressing if a.group.name == "mtp"]
    if len(mtp) != 1:
        names = [a.group.name for a in addressing]
        raise ValueError(f"the MTP module needs one 'mtp' ring group, the model declared {names}")
    # an MTP pass runs its layers beside the model's: their share of a step, from the config (alike on every rank)
    cost = len(model.mtp.layers) / hf_config.num_hidden_layers if model.mtp is not None and hf_config else 0.0
    return MtpDrafter(config, model, PassMetadata(mtp, device), draft_length(config, cost, sunk=True))


def draft_length(config: SpeculativeConfig, draft_cost: float, sunk: bool) -> DraftLength:
    """The drafts' length rule of `config` (spec_decode/draft_length.py); `draft_cost`: one draft pass
    as a share of a decode step."""
    return DraftLength(config.draft_length == "adaptive", draft_cost, config.row_cost, sunk)


def draft_model_cost(draft_path: str | None, target_path: str | None) -> float:
    """A draft pass as a share of a decode step: the draft checkpoint's weight bytes over the target's
    (decode reads each weight once). From the files, so every rank of a split model prices it alike
    (each holds its own slices); 1.0 (as dear as the model) where the files say nothing (dummy weights)."""
    draft, target = checkpoint_bytes(draft_path), checkpoint_bytes(target_path)
    return draft / target if draft and target else 1.0


def checkpoint_bytes(path: str | None) -> int:
    """Bytes of a checkpoint's weight files: a GGUF (every part of a split set), or a directory's
    .safetensors / .bin / .gguf files; 0 for anything else."""
    if path is None:
        return 0
    if os.path.isfile(path):
        return sum(os.path.getsize(p) for p in gguf_parts(path)) if path.endswith(".gguf") else 0
    if os.path.isdir(path):
        return sum(entry.stat().st_size for entry in os.scandir(path)
                   if entry.is_file() and entry.name.endswith((".safetensors", ".bin", ".gguf")))
    return 0
