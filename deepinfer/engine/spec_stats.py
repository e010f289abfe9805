"""Counters of speculative decoding: drafts proposed, verified and accepted. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Since start: `num_drafts` verification steps (one per request per step that carried
    drafts), `num_draft_tokens` drafts they checked, `num_accepted_tokens` drafts accepted, and
    `accepted_per_position[i]` how often draft i (0-based) of a step was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification step of `num_draft_tokens` drafts of which the first `num_accepted` held."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"num_accepted={num_accepted} must lie in [0, num_draft_tokens={num_draft_tokens}]")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts checked (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: 1 (the target's own) + accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
                "spec_decode_acceptance_rate": self.acceptance_rate,
                "spec_decode_mean_accepted_length": self.mean_accepted_length}
