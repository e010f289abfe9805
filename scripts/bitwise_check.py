"""Token ids and logprobs of fixed requests, for checking that a refactor changed no bit.

    python scripts/bitwise_check.py dump OUT.json      # run the requests, write what came out
    python scripts/bitwise_check.py compare A.json B.json

Models: the default SmolLM2-135M GGUF, Gemma 3 270M (its pip package), and a tiny random
DeepSeek-V4 (sliding, CSA and HCA layers, built here with transformers). Each runs greedy and
seeded requests on three paths: plain torch (DEEPINFER_CPU_ISA=none), the fused C++ kernels (the
CPU default) and the Triton kernels under the interpreter. Each path runs in a process of its own
(the kernel choice is read once per process). Run `dump` before and after a change, then `compare`:
the two files must be equal, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

PATHS = {"torch": {"DEEPINFER_CPU_ISA": "none"}, "fused": {}, "triton": {"TRITON_INTERPRET": "1"}}
PROMPTS = ["The capital of France is", "Write a haiku about caches:", "1, 2, 3, 5, 8,"]


def _requests():
    from deepinfer import SamplingParams

    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, logprobs=2, ignore_eos=True)
    return [("greedy", greedy), ("seeded", seeded)]


def _tiny_v4(folder: str) -> str:
    sys.path.insert(0, os.path.join(os.getcwd(), "tests", "models", "deepseek_v4"))  # run from the checkout
    from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

    path = os.path.join(folder, "tiny-v4")
    make_tiny_v4(path, [SLIDING, CSA, HCA])
    return path


def _run(model: str, path_name: str) -> dict:
    from deepinfer import LLM

    backend = "triton" if path_name == "triton" else "torch"
    is_v4 = model is not None and os.path.isdir(model)
    prompts = [[5, 17, 99, 3, 250, 41, 8, 77], [9, 8, 7, 6, 5, 4, 3, 2, 1, 300]] if is_v4 else PROMPTS
    out = {}
    with LLM(model, attention_backend=backend, max_model_len=128, kv_cache_memory="64MiB",
             dtype="float32", enable_prefix_caching=False) as llm:
        for name, params in _requests():
            for i, result in enumerate(llm.generate(prompts, params, use_tqdm=False)):
                completion = result.outputs[0]
                logprobs = [{str(t): lp.logprob for t, lp in sorted(pos.items())} for pos in completion.logprobs]
                out[f"{name}/{i}"] = {"ids": completion.token_ids, "logprobs": logprobs}
    return out


def dump(target: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        models = {"smollm2": None, "gemma3": "gemma3-270m", "tiny-v4": _tiny_v4(folder)}
        results = {}
        for model_name, model in models.items():
            for path_name, env in PATHS.items():
                if model_name == "gemma3" and path_name == "triton":
                    continue  # 18 layers interpreted: minutes for a few tokens
                code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                        f"import bitwise_check as b; print(json.dumps(b._run({model!r}, {path_name!r})))")
                proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                                      capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{model_name}/{path_name} failed:\n{proc.stderr[-3000:]}")
                results[f"{model_name}/{path_name}"] = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"{model_name}/{path_name}: done", file=sys.stderr)
    with open(target, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def compare(a: str, b: str) -> int:
    with open(a) as f:
        left = json.load(f)
    with open(b) as f:
        right = json.load(f)
    bad = [key for key in sorted(set(left) | set(right)) if left.get(key) != right.get(key)]
    for key in bad:
        print(f"differs: {key}")
    print(f"{len(left)} runs compared, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
