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

import torch

from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.drafting import Drafter
from deepinfer.spec_decode.draft_length import DraftLength
from deepinfer.spec_decode.draft_model import DraftModelDrafter
from deepinfer.spec_decode.drafter import NgramDrafter
from deepinfer.spec_decode.mtp import MtpDrafter
from deepinfer.worker.draft_cache import DraftCache
from deepinfer.worker.input_batch import PassMetadata
from deepinfer.worker.summary import weight_bytes


def make_drafter(config: SpeculativeConfig, model, addressing: list, device: torch.device,
                 draft: DraftCache | None = None, vocab_size: int = 0, max_model_len: int = 0) -> Drafter | None:
    """The drafter of `config.method` (None without one); "mtp" drafts over the "mtp" group of
    `addressing`; "draft_model" drafts with `draft`'s model ids below `vocab_size` (the target's), at
    positions below `max_model_len`."""
    if config.method is None:
        return None
    if config.method == "ngram":
        return NgramDrafter(config, draft_length(config, 0.0, sunk=False))
    if config.method == "draft_model":
        if draft is None:
            raise ValueError("speculative_method='draft_model' needs speculative_model (a draft checkpoint)")
        cost = weight_bytes(draft.model) / max(weight_bytes(model), 1)
        return DraftModelDrafter(config, draft, vocab_size, max_model_len, draft_length(config, cost, sunk=True))
    mtp = [a for a in addressing if a.group.name == "mtp"]
    if len(mtp) != 1:
        names = [a.group.name for a in addressing]
        raise ValueError(f"the MTP module needs one 'mtp' ring group, the model declared {names}")
    return MtpDrafter(config, model, PassMetadata(mtp, device), draft_length(config, mtp_share(model), sunk=True))


def draft_length(config: SpeculativeConfig, draft_cost: float, sunk: bool) -> DraftLength:
    """The drafts' length rule of `config` (spec_decode/draft_length.py); `draft_cost`: one draft pass
    as a share of a decode step (the drafter's weight bytes over the model's)."""
    return DraftLength(config.draft_length == "adaptive", draft_cost, config.row_cost, sunk)


def mtp_share(model) -> float:
    """The MTP module's share of the model's weight bytes (what one MTP pass reads of a decode step's)."""
    return weight_bytes(model.mtp) / max(weight_bytes(model), 1) if model.mtp is not None else 0.0
