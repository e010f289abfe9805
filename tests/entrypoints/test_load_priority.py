"""A model host's child loads under SCHED_BATCH and puts every thread back under SCHED_OTHER once loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer.entrypoints.model_host.load_priority import LOADING_ENV, child_env

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                                 reason="per-thread scheduling policies are Linux's")]

CHILD = """
import json, os, threading
from deepinfer.entrypoints.model_host.load_priority import lower_for_load, restore_after_load
lower_for_load()
started = threading.Event(); done = threading.Event()
worker = threading.Thread(target=lambda: (started.set(), done.wait()))  # a thread made while loading
worker.start(); started.wait()
loading = os.sched_getscheduler(worker.native_id)
restore_after_load()
after = {os.sched_getscheduler(int(tid)) for tid in os.listdir("/proc/self/task")}
done.set(); worker.join()
print(json.dumps({"loading": loading, "after": sorted(after), "nice": os.nice(0)}))
"""


def _run(env) -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                                     check=True).stdout)


def test_a_child_loads_as_a_batch_job_and_every_thread_comes_back():
    out = _run({**os.environ, **child_env()})
    assert out["loading"] == os.SCHED_BATCH  # a thread started while loading inherits the policy
    assert out["after"] == [os.SCHED_OTHER]  # leaving SCHED_BATCH needs no privilege
    assert out["nice"] == os.nice(0)  # the niceness is never touched: a busy machine loads it as fast


def test_a_server_no_host_started_keeps_its_policy():
    env = {k: v for k, v in os.environ.items() if k != LOADING_ENV}
    code = ("import os; from deepinfer.entrypoints.model_host.load_priority import restore_after_load; "
            "os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); restore_after_load(); "
            "print(os.sched_getscheduler(0))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert int(out) == os.SCHED_BATCH
