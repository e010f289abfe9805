"""Token ids and logprobs of fixed requests, for checking that a refactor changed no bit.

    python scripts/bitwise_check.py dump OUT.json      # run the requests, write what came out
    python scripts/bitwise_check.py compare A.json B.json

Models: the default SmolLM2-135M GGUF, Gemma 3 270M (its pip package), and one tiny random
checkpoint per family, built here with transformers by the tests' builders: Llama (and Llama 3
RoPE), Mistral with a window on every layer, Qwen2 (mixed windows), Qwen3, Gemma 2, Gemma 3, Phi-3
(window; LongRoPE), Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS (MXFP4 experts), DeepSeek-V2, DeepSeek-V3
(and its MTP drafter), DeepSeek-V4 (sliding, CSA and HCA layers); Llama and Qwen3-MoE also with int8
weights quantized at load. Each runs greedy and seeded requests on three paths: plain torch
(DEEPINFER_CPU_ISA=none), the fused C++ kernels (the CPU default) and the Triton kernels under the
interpreter. Each path runs in a process of its own (the kernel choice is read once per process).
Run `dump` before and after a change, then `compare`: the two files must be equal, bit for bit.
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


TINY_LLAMA = ("llama", "llama3", "mistral_swa", "qwen2_swa", "qwen3", "gemma3")
TINY_FAMILIES = ("gemma2", "phi3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3")
OPTIONS = {"llama-int8": {"quantization": "int8"}, "qwen3_moe-int8": {"quantization": "int8"},
           "deepseek_v3-mtp": {"speculative_method": "mtp", "num_speculative_tokens": 1}}


def _tests_on_path() -> str:
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    for folder in (tests, os.path.join(tests, "models"), os.path.join(tests, "models", "deepseek_v3"),
                   os.path.join(tests, "models", "deepseek_v4")):
        sys.path.insert(0, folder)
    return tests


def _tokenizer(folder: str) -> str:
    from transformers import AutoTokenizer

    from deepinfer.model_executor.loader.default_model import default_model_path

    gguf = default_model_path()
    path = os.path.join(folder, "tokenizer")
    AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)).save_pretrained(path)
    return path


def _tiny_models(folder: str) -> dict[str, str]:
    """name -> checkpoint folder, one per family (module docstring)."""
    _tests_on_path()
    from family_checkpoints import make_family_checkpoint
    from gemma2_phi3_models import make_checkpoint
    from tiny_models import make_tiny_checkpoint
    from v3_tiny import add_tensors, hf_mtp, make_tiny, mtp_checkpoint_tensors
    from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

    tokenizer, models = _tokenizer(folder), {}
    for arch in TINY_LLAMA:
        models[arch] = os.path.join(folder, arch)
        make_tiny_checkpoint(arch, models[arch], tokenizer)
    for family in TINY_FAMILIES:
        models[family] = os.path.join(folder, family)
        make_family_checkpoint(family, models[family], tokenizer)
    models["phi3_longrope"] = os.path.join(folder, "phi3_longrope")
    make_checkpoint("phi3_longrope", models["phi3_longrope"], tokenizer)
    models["deepseek_v3-mtp"] = os.path.join(folder, "deepseek_v3-mtp")
    hf = make_tiny(models["deepseek_v3-mtp"], num_nextn_predict_layers=1)
    add_tensors(models["deepseek_v3-mtp"], mtp_checkpoint_tensors(hf_mtp(hf), hf.config.num_hidden_layers))
    models["tiny-v4"] = os.path.join(folder, "tiny-v4")
    make_tiny_v4(models["tiny-v4"], [SLIDING, CSA, HCA])
    for name in ("llama-int8", "qwen3_moe-int8"):
        models[name] = models[name.split("-")[0]]
    return models


def _run(model: str, path_name: str, options: dict) -> dict:
    from deepinfer import LLM

    backend = "triton" if path_name == "triton" else "torch"
    tiny = model is not None and os.path.isdir(model)  # token ids below every tiny vocabulary (512)
    prompts = [[5, 17, 99, 3, 250, 41, 8, 77, 5, 17, 99], [9, 8, 7, 6, 5, 4, 3, 2, 1, 300]] if tiny else PROMPTS
    out = {}
    with LLM(model, attention_backend=backend, max_model_len=128, kv_cache_memory="64MiB",
             dtype="float32", enable_prefix_caching=False, **options) as llm:
        for name, params in _requests():
            for i, result in enumerate(llm.generate(prompts, params, use_tqdm=False)):
                completion = result.outputs[0]
                logprobs = [{str(t): lp.logprob for t, lp in sorted(pos.items())} for pos in completion.logprobs]
                out[f"{name}/{i}"] = {"ids": completion.token_ids, "logprobs": logprobs}
    return out


def dump(target: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        models = {"smollm2": None, "gemma3-270m": "gemma3-270m", **_tiny_models(folder)}
        only = [m for m in os.environ.get("BITWISE_ONLY", "").split(",") if m]
        results = {}
        for model_name, model in models.items():
            if only and model_name not in only:
                continue
            for path_name, env in PATHS.items():
                if model_name == "gemma3-270m" and path_name == "triton":
                    continue  # 18 layers interpreted: minutes for a few tokens
                code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                        f"import bitwise_check as b; "
                        f"print(json.dumps(b._run({model!r}, {path_name!r}, {OPTIONS.get(model_name, {})!r})))")
                proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                                      capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"{model_name}/{path_name} failed:\n{proc.stderr[-3000:]}")
                results[f"{model_name}/{path_name}"] = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"{model_name}/{path_name}: done", file=sys.stderr)
    with open(target, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def compare(a: str, b: str) -> int:
    """Runs present in both files must be equal; a run in one file only is listed (BITWISE_ONLY
    dumps a subset) and fails the comparison only when neither file has a run in common."""
    with open(a) as f:
        left = json.load(f)
    with open(b) as f:
        right = json.load(f)
    common = sorted(set(left) & set(right))
    bad = [key for key in common if left[key] != right[key]]
    for key in bad:
        print(f"differs: {key}")
    for key in sorted(set(left) ^ set(right)):
        print(f"only in {a if key in left else b}: {key}")
    print(f"{len(common)} runs compared, {len(bad)} differ")
    return 1 if bad or not common else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
