"""How rank 0 hands each step plan to the follower ranks, and the parts of a tensor-parallel run
that do not depend on how the followers were started.

    rank 0: DriverRunner.execute(plan)                follower r: follow_plans(runner, channel)
    ───────────────────────────────────               ─────────────────────────────────────────
    channel.send(follower_plan(plan)) ──────────────> plan = channel.recv()
    step = driver.steps.start(plan) <──────────────> runner.steps.follow(plan): start: forward
                          (the layers' collectives pair up inside the forward)
    where step.needs_tokens (a plan that verifies drafts, or any plan with a drafter that runs the
    model, MTP) -- the send point, after sampling and before any drafting pass:
    channel.send(step.tokens()) ────────────────────> StepTokens = channel.recv()
    driver.steps.finish(step): keep_verified, MTP <> finish: keep_verified(kept counts), MTP passes
    close(): channel.send(None) ────────────────────> None: leave the loop

Both messages are contract types (`StepPlan`, `StepTokens` in `contracts/plan.py`). The step
tokens (each request's sampled token ids) let a model with per-request state beside the caches
(DeepSeek-V4's compressors) forget rejected drafts on every rank, not on rank 0 alone, and let
every rank run the MTP module's passes (their collectives pair up; the drafts are rank 0's).
Rank 0 sends them before its own drafting passes, or the ranks deadlock: its first pass would
wait in a collective for followers that wait for the tokens.

Two channels:
- `PipeChannel`: one pipe per spawned worker on this machine (`worker/multiproc.py`); the plan is
  pickled once and written to every pipe.
- `BroadcastChannel`: `broadcast_object_list` from rank 0 on a gloo group of its own
  (`worker/torchrun.py`, ranks possibly on several machines). That group's timeout is very long: a
  follower waits for its next plan for as long as the engine idles. The collectives inside a step
  run on the tensor-parallel group and keep its normal timeout.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import pickle
from typing import Protocol

import torch.distributed as dist

from deepinfer.contracts.plan import FatalStepError, ModelOutput, StepPlan, StepTokens, describe_fault

IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a follower may wait for the next plan


Message = StepPlan | StepTokens | None


class PlanChannel(Protocol):
    """Rank 0 sends each plan, the step tokens after it where followers need them, and None at
    close; a follower receives them in order."""

    def send(self, message: Message) -> None: ...

    def recv(self) -> Message: ...


class PipeChannel:
    """Plans over local pipes: `send` writes to every connection (rank 0 holds one per worker),
    `recv` reads from the first (a worker holds its own). EOFError on a closed pipe."""

    def __init__(self, connections):
        self.connections = list(connections)

    def send(self, message: Message) -> None:
        payload = pickle.dumps(message)
        for conn in self.connections:
            conn.send_bytes(payload)

    def recv(self) -> Message:
        return pickle.loads(self.connections[0].recv_bytes())


class BroadcastChannel:
    """Plans broadcast from rank 0 over `group` (a gloo group: plans are pickled on the CPU, whatever
    device the model runs on). Every rank of the group must call in the same order."""

    def __init__(self, group):
        self.group = group

    @classmethod
    def new(cls) -> BroadcastChannel:
        """A channel on a new gloo group of all ranks, with IDLE_TIMEOUT (collective: every rank calls it)."""
        return cls(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))

    def send(self, message: Message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self) -> Message:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def follower_plan(plan: StepPlan, histories: bool = False) -> StepPlan:
    """What a follower needs of a plan: all of it but the token histories kept for penalties and
    drafting (the prompt stays where prompt logprobs score it); `histories`: all of it (MTP
    drafting on every rank reads them)."""
    if histories:
        return plan
    scheduled = [dataclasses.replace(s, output_token_ids=[],
                                     prompt_token_ids=s.prompt_token_ids if s.prompt_logprobs is not None else [])
                 for s in plan.scheduled]
    return dataclasses.replace(plan, scheduled=scheduled)


class _Closed(Exception):
    """Rank 0 closed the channel where a follower waited for step tokens (its step failed)."""


def follow_plans(runner, channel: PlanChannel) -> None:
    """A follower's loop: run every plan rank 0 sends (`StepExecutor.follow`, which reads a plan's
    `StepTokens` from the channel too, where it needs them) until None."""

    def step_tokens() -> StepTokens:
        message = channel.recv()
        if message is None:
            raise _Closed
        if not isinstance(message, StepTokens):
            raise RuntimeError(f"expected rank 0's StepTokens mid-step, got a {type(message).__name__}: "
                               f"the ranks are out of step")
        return message

    try:
        while (plan := channel.recv()) is not None:
            runner.steps.follow(plan, step_tokens)
    except _Closed:
        pass


class DriverRunner(abc.ABC):
    """The engine's `StepRunner` on rank 0 of a tensor-parallel run: rank 0's ModelRunner (`driver`:
    it samples) plus followers reached through `channel`. Every other attribute (groups, num_blocks,
    model, caches, steps, ...) is the driver's. Subclasses start the followers, set `driver` and `channel`,
    implement `close`, and may override `_step_fault` to name a dead rank."""

    failure: str | None = None  # why the ranks can no longer step together

    def __getattr__(self, name: str):
        if name in ("driver", "channel"):  # not built (start-up failed): no recursion
            raise AttributeError(name)
        return getattr(self.driver, name)

    @property
    def config(self):
        """The EngineConfig rank 0's runner was built from (max_model_len resolved, alike on every rank)."""
        return self.driver.config

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Send the plan to every follower, run it here up to the send point (forward and
        sampling), send the step's tokens where the followers need them, then finish it (drafting
        passes, snapshots). Any failure is a FatalStepError: the ranks are out of step (some may
        wait in a collective)."""
        if self.failure is not None:
            raise FatalStepError(self.failure)
        try:
            self.channel.send(follower_plan(plan, histories=self.driver.steps.drafts_on_every_rank))
            step = self.driver.steps.start(plan)
            if step.needs_tokens:  # the send point: after sampling, before any drafting pass
                self.channel.send(step.tokens())
            return self.driver.steps.finish(step)
        except BaseException as exc:
            raise self._step_fault(exc) from exc

    def release(self, request_ids) -> None:
        self.driver.release(request_ids)  # followers keep no per-request state outside the caches

    def stats(self) -> dict[str, int]:
        """Rank 0's counters (its cache directory's slice files)."""
        return self.driver.stats()

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the followers and close the driver; subclasses say how."""

    def _step_fault(self, exc: BaseException) -> BaseException:
        """A failed step as the exception to raise (interrupts stay what they are)."""
        if self.failure is None:
            self.failure = f"tensor-parallel rank 0: {describe_fault('a step', exc)}; the ranks are out of step"
        return FatalStepError(self.failure) if isinstance(exc, Exception) else exc
