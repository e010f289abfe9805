"""A step whose runner raises, pinned on the requests that caused it (the engine's fault isolation,
`engine/llm_engine.py`):

    runner.execute(plan) raises ----> each request again, alone (sub-plans of one request); those
                                      whose solo step fails are failed (`ModelOutput.errors`), the
                                      others' results used (the runner has put back what the step
                                      changed that a re-run reads: `StepRunner.execute`)
    a one-request step raises ------> that request fails; a second one in a row is not per-request
    a fatal fault, or every solo -----> propagates (the engine's state is then unknown)
    re-run failing
"""

from __future__ import annotations

import logging

from deepinfer.contracts.model import StepRunner
from deepinfer.contracts.plan import ModelOutput, StepPlan, describe_fault, is_fatal_fault

logger = logging.getLogger("deepinfer.engine")
MAX_LONE_FAILURES = 2  # one-request steps failing in a row before the fault counts as not per-request


class IsolatedSteps:
    """Runs the engine's steps on its runner (the engine's `runner`, passed each step), turning a
    fault one request causes into that request's error."""

    def __init__(self):
        self.lone_failures = 0  # one-request steps that failed in a row

    def execute(self, runner: StepRunner, plan: StepPlan) -> ModelOutput:
        """The runner's step; if it raises, find the culprits by running each request alone."""
        try:
            output = runner.execute(plan)
        except Exception as exc:
            if is_fatal_fault(exc):
                raise
            if len(plan.scheduled) < 2:
                return self._fail_lone_request(plan, exc)
            logger.warning("%s; running its %d requests one at a time to find the culprit",
                           describe_fault("a step", exc), len(plan.scheduled))
            output = self._execute_alone(runner, plan, exc)
        if plan.scheduled:
            self.lone_failures = 0
        return output

    def _fail_lone_request(self, plan: StepPlan, exc: Exception) -> ModelOutput:
        """A step of one request failed: nothing to compare with. The request fails alone, but
        a second such step in a row (another request failing the same way) is fatal."""
        self.lone_failures += 1
        if self.lone_failures >= MAX_LONE_FAILURES:
            raise exc
        request_id = plan.scheduled[0].request_id
        logger.error("request %r failed in its model step", request_id, exc_info=exc)
        return ModelOutput(errors={request_id: describe_fault("model step", exc)})

    def _execute_alone(self, runner: StepRunner, plan: StepPlan, exc: Exception) -> ModelOutput:
        """Re-run the plan one request at a time (finished / preempted ids go with the first).

        Re-running is safe: a store writes the same values to the same slots, and a runner whose
        step raised has put back what the step changed that a re-run reads (`StepRunner.execute`:
        DeepSeek-V4's compressor states, ring rows a chunk loaded and overwrote). Every solo
        re-run failing means the fault is not one request's: the original exception propagates."""
        output, failures = ModelOutput(), {}
        for i, sched in enumerate(plan.scheduled):
            solo = StepPlan([sched], plan.finished_request_ids if i == 0 else [],
                            plan.preempted_request_ids if i == 0 else [], plan.persist if i == 0 else [])
            try:
                result = runner.execute(solo)
            except Exception as solo_exc:
                if is_fatal_fault(solo_exc):
                    raise
                failures[sched.request_id] = solo_exc
                continue
            output.update(result)
        if len(failures) == len(plan.scheduled):
            raise exc
        for request_id, solo_exc in failures.items():
            logger.error("request %r failed in its model step", request_id, exc_info=solo_exc)
            output.errors[request_id] = describe_fault("model step", solo_exc)
        return output
