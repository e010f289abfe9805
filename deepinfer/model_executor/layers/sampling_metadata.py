"""SamplingMetadata: what the sampler needs to know about the rows of one step's logits.

The worker builds it once per step from its own request state (deepinfer/worker/sampling_inputs.py),
so the sampler depends on plain lists and tensors, never on the scheduler's plan types.
The helpers below it build a stage's tensors from a row list on the logits' device
(`device_tensor`, `fp32_column`, `row_index`, `row_subset`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling_params import SamplingParams

MIN_TEMPERATURE = 1e-5  # smaller temperatures are clamped: logits / T must stay finite


@dataclass
class SamplingMetadata:
    """Per logits row (N rows; row i is logits[i]): its request, its parameters, its token history,
    and what the sampler derives from the parameters, computed once in `from_rows`.

    Owns the row partitions (greedy / random, penalized, with logprobs) and the per-row parameter
    tensors, on the device given to `from_rows` (the logits' device). Does not own the token
    histories: they are the caller's lists, referenced, not copied, and must stay unchanged until
    the sampler has run. A subset field lists its rows in the order of its row list: `temperature`
    row j belongs to logits row `random_rows[j]`. A subset tensor is None when no row needs it.
    """

    request_ids: list[str]  # [N]
    params: list[SamplingParams]  # [N]
    prompt_token_ids: list[list[int]]  # [N] lists, for the repetition penalty (references)
    output_token_ids: list[list[int]]  # [N] lists, for all penalties (references)
    greedy_rows: list[int]  # [G] temperature 0: argmax, no draw
    random_rows: list[int]  # [R] the others, ascending: one uniform each, in this order
    temperature: torch.Tensor | None  # [R, 1] fp32, clamped to >= MIN_TEMPERATURE
    min_p: torch.Tensor | None  # [R, 1] fp32; 0: off
    top_k: list[int]  # [R]; 0: off
    top_p: list[float]  # [R]; 1: off
    any_filter: bool  # some random row sets top-k, top-p or min-p
    seeded_draws: list[int]  # positions in random_rows drawing from their request's own generator
    unseeded_draws: list[int]  # positions in random_rows drawing from the engine generator
    penalty_rows: list[int]  # [P] rows with some penalty, ascending
    repetition_penalty: torch.Tensor | None  # [P, 1] fp32; None when every penalty row has 1
    presence_penalty: torch.Tensor | None  # [P, 1] fp32; None (with frequency) when all are 0
    frequency_penalty: torch.Tensor | None  # [P, 1] fp32; None (with presence) when all are 0
    logprob_rows: list[int]  # rows with logprobs set (0 included), ascending
    num_top_logprobs: int  # the largest logprobs n over logprob_rows; 0 when none
    processor_rows: list[int] = dataclasses.field(default_factory=list)  # rows with logit_bias / bans to apply
    any_ban: bool = False  # some row may get a -inf (min_tokens still unmet, or bad words)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def all_greedy(self) -> bool:
        return not self.random_rows

    @property
    def all_random(self) -> bool:
        return not self.greedy_rows

    @classmethod
    def from_rows(cls, request_ids: Sequence[str], params: Sequence[SamplingParams | None],
                  prompt_token_ids: Sequence[list[int]], output_token_ids: Sequence[list[int]],
                  device: torch.device | str) -> SamplingMetadata:
        """One entry per logits row in each list. Raises ValueError for a row without params."""
        checked = _checked_params(request_ids, params, prompt_token_ids, output_token_ids)
        random_rows = [i for i, p in enumerate(checked) if not p.greedy]
        penalty_rows = [i for i, p in enumerate(checked) if p.needs_penalties]
        logprob_rows = [i for i, p in enumerate(checked) if p.logprobs is not None]
        drawing = [checked[i] for i in random_rows]
        penalized = [checked[i] for i in penalty_rows]
        counts = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in penalized)
        return cls(
            request_ids=list(request_ids), params=checked,
            prompt_token_ids=list(prompt_token_ids), output_token_ids=list(output_token_ids),
            greedy_rows=[i for i, p in enumerate(checked) if p.greedy], random_rows=random_rows,
            temperature=_column([max(p.temperature, MIN_TEMPERATURE) for p in drawing], device),
            min_p=_column([p.min_p for p in drawing], device),
            top_k=[p.top_k for p in drawing], top_p=[p.top_p for p in drawing],
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in drawing),
            seeded_draws=[j for j, p in enumerate(drawing) if p.seed is not None],
            unseeded_draws=[j for j, p in enumerate(drawing) if p.seed is None],
            penalty_rows=penalty_rows,
            repetition_penalty=(_column([p.repetition_penalty for p in penalized], device)
                                if any(p.repetition_penalty != 1.0 for p in penalized) else None),
            presence_penalty=_column([p.presence_penalty for p in penalized], device) if counts else None,
            frequency_penalty=_column([p.frequency_penalty for p in penalized], device) if counts else None,
            logprob_rows=logprob_rows,
            num_top_logprobs=max((checked[i].logprobs for i in logprob_rows), default=0),
            processor_rows=[i for i, p in enumerate(checked) if p.logit_bias or _may_ban(p, output_token_ids[i])],
            any_ban=any(_may_ban(p, out) for p, out in zip(checked, output_token_ids, strict=True)))


def _checked_params(request_ids: Sequence[str], params: Sequence[SamplingParams | None],
                    prompt_token_ids: Sequence[list[int]],
                    output_token_ids: Sequence[list[int]]) -> list[SamplingParams]:
    """The params, once every list has one entry per row and no row lacks its params."""
    lengths = {len(request_ids), len(params), len(prompt_token_ids), len(output_token_ids)}
    if len(lengths) != 1:
        raise ValueError(f"one entry per row expected, got {len(request_ids)} request ids, {len(params)} params, "
                         f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs")
    for request_id, p in zip(request_ids, params, strict=True):
        if p is None:
            raise ValueError(f"request {request_id!r} was given to the sampler without sampling_params")
    return list(params)


def _may_ban(params: SamplingParams, output_token_ids: list[int]) -> bool:
    """Whether the row may ban a token: bad words, or min_tokens unmet with stop ids to mask."""
    return bool(params._bad_words_token_ids) or (len(output_token_ids) < params.min_tokens
                                                 and bool(params.all_stop_token_ids))


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values -> [n] on `device`, built on the host and copied with non_blocking=True: unlike
    `torch.tensor(values, device=...)`, the host does not wait for the copy."""
    host = torch.tensor(values, dtype=dtype)  # [n]
    return host if torch.device(device).type == "cpu" else host.to(device, non_blocking=True)  # [n]


def fp32_column(values: Sequence[float], device: torch.device | str) -> torch.Tensor:
    """values -> [n, 1] fp32 on `device`."""
    return device_tensor(values, torch.float32, device)[:, None]  # [n, 1]


def _column(values: list[float], device: torch.device | str) -> torch.Tensor | None:
    """`fp32_column`, or None for no values (no tensor, no host-to-device copy)."""
    return fp32_column(values, device) if values else None  # [n, 1]


def row_index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """A row list (`greedy_rows`, `logprob_rows`, ...) -> [n] long on `like`'s device."""
    return device_tensor(rows, torch.long, like.device)  # [n]


def row_subset(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows of logits [N, V] a stage applies to: (logits itself, None) when all rows, else
    (a copy [n, V] of those rows, their index [n])."""
    if len(rows) == logits.shape[0]:
        return logits, None
    index = row_index(rows, logits)  # [n]
    return logits.index_select(0, index), index  # [n, V]
