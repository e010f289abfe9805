"""What tensor parallelism costs per step on this machine: batch-1 decode ms/token at
tensor_parallel_size 1 and 2 (two processes, gloo), dummy fp32 weights, a small Qwen3-shaped model,
or a model named on the command line (e.g. gemma3-270m: a GGUF whose slices stay packed per rank).

    python scripts/tp_overhead.py [MODEL]    (OMP_NUM_THREADS=1 to keep two ranks off each other's cores)

Each step of the model below runs 2 * layers + 1 all-reduces (one per attention block, one per
MLP, one for the vocabulary-split embedding) and one all-gather of the logits.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from deepinfer import LLM, SamplingParams  # noqa: E402

SHAPE = dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=8192)
PROMPT = {"prompt_token_ids": list(range(100, 132))}


def ms_per_token(tp: int, model: str | None) -> tuple[float, int]:
    """(time of 65 outputs - time of 1) / 64, each the best of 3 after a warm-up; and the layers."""
    dummy = dict(load_format="dummy", dtype="float32", hf_overrides=SHAPE)
    llm = LLM(model or os.path.join(ROOT, "configs", "qwen3_0_6b"), device="cpu", tensor_parallel_size=tp,
              max_model_len=512, max_num_seqs=4, enable_prefix_caching=False, **({} if model else dummy))

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        return time.perf_counter() - start

    def best(n: int) -> float:
        return min(run(n) for _ in range(3))

    run(4)
    ms = (best(65) - best(1)) / 64 * 1e3
    layers = llm.engine.source.hf_config.num_hidden_layers
    llm.close()
    return ms, layers


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else None
    (one, layers), (two, _) = ms_per_token(1, model), ms_per_token(2, model)
    reduces = 2 * layers + 1
    print(f"tp=1 {one:.2f} ms/token; tp=2 {two:.2f} ms/token; {reduces} all-reduces per step: "
          f"{(two - one) / reduces * 1e3:.0f} us each beyond the split compute")


if __name__ == "__main__":
    main()
