"""The one step skeleton (`StepExecutor.start` / `finish`) and rank 0's per-step messages, in one
process: a `DriverRunner` whose channel records what it sends, and a second runner that follows
the recording as a follower rank would (`follow_plans`)."""

from __future__ import annotations

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import StepPlan, StepTokens
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.plan_channel import DriverRunner, follow_plans


class _Recorder:
    """A channel that keeps every message, and the drafter's passes in the same list."""

    def __init__(self):
        self.events: list = []

    def send(self, message) -> None:
        self.events.append(message)


class _OneRankDriver(DriverRunner):
    """Rank 0's wrapper with no follower behind its channel."""

    def __init__(self, driver: ModelRunner, channel: _Recorder):
        self.driver, self.channel = driver, channel

    def close(self) -> None:
        self.driver.close()


class _Replay:
    """A follower's channel: the recorded messages in order, then None."""

    def __init__(self, messages):
        self.messages = iter([*messages, None])

    def recv(self):
        return next(self.messages)


def _record_drafting(runner: ModelRunner, events: list) -> None:
    propose = runner.steps.drafter.propose

    def recorded(inputs, samples):
        events.append("propose")
        return propose(inputs, samples)

    runner.steps.drafter.propose = recorded


def test_rank0_sends_step_tokens_before_drafting_and_a_follower_keeps_step(tiny_checkpoint):
    with LLM(tiny_checkpoint("llama"), max_model_len=128, enable_prefix_caching=False, speculative_method="ngram",
             num_speculative_tokens=2) as llm:
        engine, channel = llm.engine, _Recorder()
        driver = engine.runner
        _record_drafting(driver, channel.events)
        engine.runner = _OneRankDriver(driver, channel)
        prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
        steps, step = [], None
        for event in channel.events:
            if isinstance(event, StepPlan):
                steps.append(step := [event])
            else:
                step.append(event)
        verifying = [s for s in steps if any(r.verify for r in s[0].scheduled)]
        assert verifying, "the repetitive prompts were drafted for and verified"
        for s in steps:
            kinds = [type(e).__name__ if not isinstance(e, str) else e for e in s[1:]]
            if s in verifying:  # the send point: after sampling, before the drafter's pass
                assert kinds == ["StepTokens", "propose"], kinds
                assert all(len(ids) >= 1 for ids in s[1].token_ids.values())
            else:
                assert "StepTokens" not in kinds, kinds

        follower = ModelRunner(engine.source, engine.config)
        follow_plans(follower, _Replay(e for e in channel.events if isinstance(e, (StepPlan, StepTokens))))
        assert all(torch.equal(a, b) for a, b in zip(driver.caches.cache.allocations, follower.caches.cache.allocations,
                                                      strict=True)), "the follower computed the same rows"
        follower.close()
