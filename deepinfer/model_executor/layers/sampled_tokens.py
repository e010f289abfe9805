"""A step's draws while they are still on the device, and the one read that brings them back.

The sampler computes everything a `SampleResult` holds as device tensors (`DrawnTokens`); the
host reads them once, as one float64 vector (token ids and ranks are exact in float64):

    [ token_ids (N) | logprobs (N) | ranks (n) | top ids (n * k) | top logprobs (n * k) ]

n = the rows that report logprobs (`SamplingMetadata.logprob_rows`), k = the largest number of
top logprobs any of them asks for (the top block is absent when k = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.contracts.plan import SampleResult
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata


@dataclass
class DrawnTokens:
    """One step's sampled tokens on the logits' device; nothing has been read back yet."""

    token_ids: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] fp32: each token's logprob under the raw logits
    ranks: torch.Tensor | None  # [n] long: 1-based rank of the token of each logprob row; None: no such row
    top_ids: torch.Tensor | None  # [n, k] long: the best k ids of each logprob row; None when k = 0
    top_logprobs: torch.Tensor | None  # [n, k] fp32: their logprobs


def read_samples(drawn: DrawnTokens, metadata: SamplingMetadata) -> list[SampleResult]:
    """One `SampleResult` per row of `metadata`, from one device-to-host read of `drawn`."""
    parts = [drawn.token_ids, drawn.logprobs]
    parts += [] if drawn.ranks is None else [drawn.ranks]
    parts += [] if drawn.top_ids is None else [drawn.top_ids.flatten(), drawn.top_logprobs.flatten()]
    host = torch.cat([p.double() for p in parts]).tolist()  # the step's one read
    num_rows, rows = metadata.num_rows, metadata.logprob_rows
    token_ids, logprobs = host[:num_rows], host[num_rows:2 * num_rows]
    ranks = dict(zip(rows, host[2 * num_rows:2 * num_rows + len(rows)], strict=True)) if drawn.ranks is not None else {}
    top = _top_from_host(host[2 * num_rows + len(rows):], metadata) if drawn.top_ids is not None else \
        {i: [] for i in rows}
    return [SampleResult(token_id=int(t), logprob=lp, top_logprobs=top.get(i),
                         rank=int(ranks[i]) if i in ranks else None)
            for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True))]


def _top_from_host(flat: list[float], metadata: SamplingMetadata) -> dict[int, list[tuple[int, float]]]:
    """The read-back top block (ids then logprobs, [n, k] each, flattened) -> row -> its top list."""
    k, rows = metadata.num_top_logprobs, metadata.logprob_rows
    half = len(rows) * k
    ids = [[int(t) for t in flat[j * k:(j + 1) * k]] for j in range(len(rows))]
    values = [flat[half + j * k:half + (j + 1) * k] for j in range(len(rows))]
    return top_lists(metadata, ids, values)


def top_lists(metadata: SamplingMetadata, ids: list[list[int]],
              values: list[list[float]]) -> dict[int, list[tuple[int, float]]]:
    """Per logprob row j (row `metadata.logprob_rows[j]`) its ids[j] and values[j] (best first), cut
    to the number that row asks for -> row -> [(token id, logprob)]."""
    top: dict[int, list[tuple[int, float]]] = {}
    for row, row_ids, row_values in zip(metadata.logprob_rows, ids, values, strict=True):
        n = metadata.params[row].logprobs
        top[row] = list(zip(row_ids[:n], row_values[:n], strict=True))
    return top
