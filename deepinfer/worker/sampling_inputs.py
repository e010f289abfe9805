"""Worker side of the sampler's input: the step plan's sampling rows -> `SamplingMetadata`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata


def build_sampling_metadata(rows: Sequence[ScheduledRequest], device: torch.device | str) -> SamplingMetadata:
    """One metadata row per entry of `rows` (the requests that sample, in logits-row order), its
    tensors on `device` (the logits' device). The token histories are referenced, not copied.

    Raises ValueError naming the request when a row has no sampling_params.
    """
    return SamplingMetadata.from_rows(
        request_ids=[row.request_id for row in rows],
        params=[row.sampling_params for row in rows],
        prompt_token_ids=[row.prompt_token_ids for row in rows],
        output_token_ids=[row.output_token_ids for row in rows],
        device=device)
