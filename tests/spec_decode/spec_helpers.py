"""Shared pieces of the speculative-decoding tests: drafters with known answers and an engine
driver that forces aborts, checks the pools and reports every step."""

from __future__ import annotations

from deepinfer import LLM, SamplingParams


class ScriptedDrafter:
    """Drafts from a known continuation of each prompt (the plain run's greedy tokens).

    `wrong(history_len, i)` says which drafts to corrupt (+1 mod vocab), so a run mixes fully
    accepted, partly accepted and rejected verification steps; `wrong=None` drafts only the
    truth (everything accepted), `wrong=lambda *_: True` only wrong tokens (everything rejected).
    """

    runs_model = False  # drafts on rank 0 alone

    def __init__(self, continuations: dict[tuple, list[int]], k: int, vocab: int, wrong=None):
        self.continuations, self.k, self.vocab, self.wrong = continuations, k, vocab, wrong
        self.num_proposed = 0

    def propose(self, inputs, samples) -> dict[str, list[int]]:
        drafts = {}
        for s in inputs.sample_rows:
            new = samples.get(s.request_id)
            if not new:
                continue
            done = len(s.output_token_ids) + len(new)
            truth = self.continuations[tuple(s.prompt_token_ids)][done:done + self.k]
            n = len(s.prompt_token_ids) + done
            drafts[s.request_id] = [(t + 1) % self.vocab if self.wrong and self.wrong(n, i) else t
                                    for i, t in enumerate(truth)]
            self.num_proposed += len(truth)
        return drafts

    def draft_probs(self, request_id, draft_token_ids):
        return None

    def release(self, request_ids) -> None:
        pass


def mixed(history_len: int, i: int) -> bool:
    """Corrupt draft i at some history lengths: all held at some steps, a prefix at others."""
    return history_len % 3 == 0 and i == history_len % 4 or history_len % 5 == 0 and i == 0


def run_engine(llm: LLM, prompts, params: SamplingParams, abort: int | None = None, abort_at: int = 4,
               on_step=None) -> dict[int, list[int]]:
    """Run `prompts` to the end on llm's engine; abort prompt `abort` after `abort_at` steps.
    Returns prompt index -> output tokens (the aborted one left out); checks that every block
    and state slot is back in its pool."""
    engine = llm.engine
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outputs[ids[out.request_id]] = out.outputs[0].token_ids
        steps += 1
        if on_step is not None:
            on_step(engine)
        if abort is not None and steps == abort_at:
            assert engine.abort_request(next(r for r, i in ids.items() if i == abort))
    engine.kv_manager.check_no_leaks()
    outputs.pop(abort, None)
    return outputs
