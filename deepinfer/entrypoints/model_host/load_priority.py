"""A model that is loading lets the models that are answering run first.

A child's start (imports, mapping the weights, building the engine) is CPU work beside the models
already streaming tokens; on a machine with few cores it delays their steps. So the host starts each
child under SCHED_BATCH (`lower_for_load`, run in the child before it executes): Linux then treats
it as a throughput job whose wake-ups never preempt the task that runs (a streaming model's step),
yet gives it the same share of the CPU as any other process, so a busy machine loads it no slower. Once
its engine is built the child puts every thread of its own back under SCHED_OTHER, just before it
serves (`restore_after_load`): from then on it competes on equal terms.

Measured on an idle 2-core Zen 5 (tests/entrypoints/test_model_host.py, 4 runs each): the longest
gap of a stream while another model loads, in steps of ~10 ms, 1.9-2.5 under SCHED_BATCH and
2.1-2.8 without; niceness 5 or 10 narrowed it as much (1.6-2.2 at 10) but slowed a load 2-4 times
while other processes kept both cores busy.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("deepinfer.server")
LOADING_ENV = "DEEPINFER_LOADS_AS_BATCH"  # set in a host's child: restore_after_load has work to do


def _has_policies() -> bool:
    return hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH") and os.path.isdir("/proc/self/task")


def child_env() -> dict[str, str]:
    """The child's environment entry that tells it to put its threads back once loaded."""
    return {LOADING_ENV: "1"} if _has_policies() else {}


def lower_for_load() -> None:
    """In the child, before it executes: SCHED_BATCH (threads it starts inherit it)."""
    if _has_policies():
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))


def restore_after_load() -> None:
    """In a host's child once its engine is built: every thread back under SCHED_OTHER. Nothing for
    a server that no host started."""
    if os.environ.get(LOADING_ENV) != "1" or not _has_policies():
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        logger.info("this model keeps the SCHED_BATCH policy it loaded under: leaving it was refused")
    except OSError:  # a thread that ended meanwhile: the others are back
        pass
