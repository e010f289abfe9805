"""A CPU without AVX2 or AVX-512 (forced with DEEPINFER_CPU_ISA=plain): the embedded model runs on the
portable C++ dot products, with one line that says so and why, and its next-token distribution is
the SIMD path's (the dot products are the same bits; attention and norms take torch's paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.subprocess]

SCRIPT = textwrap.dedent("""
    import json
    from deepinfer import LLM, SamplingParams
    llm = LLM(max_model_len=256)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    top = out[0].outputs[0].logprobs[0]
    print(json.dumps({str(token): lp.logprob for token, lp in top.items()}))
""")


def _first_token(isa: str) -> tuple[dict[str, float], str]:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "DEEPINFER_CPU_ISA": isa})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_the_portable_path_runs_says_so_and_agrees_with_simd():
    portable, said = _first_token("plain")
    lines = [line for line in said.splitlines() if "portable C++ path" in line]
    assert lines == ["integer dot products run the portable C++ path (DEEPINFER_CPU_ISA=plain caps it): decode is "
                     "several times slower than with AVX2"], said[-2000:]
    simd, said = _first_token("avx2")
    assert "portable" not in said
    common = portable.keys() & simd.keys()
    assert len(common) >= 4, (portable, simd)
    assert max(abs(portable[t] - simd[t]) for t in common) < 0.35, (portable, simd)
