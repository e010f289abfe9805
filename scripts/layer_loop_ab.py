"""The layer loop against the modules, in one process, in turns (models/layer_loop.py).

    python scripts/layer_loop_ab.py MODEL [--tokens 128] [--rounds 12] [--threads 2]
        [--speculative-model DRAFT --num-speculative-tokens 5]

Greedy generation of `--tokens` tokens from one short prompt, alternating DEEPINFER_LAYER_LOOP=0
and 1 round by round (the first two rounds warm up and are not counted), so that a busy host's
drift falls on both sides alike. Prints the median tokens per second of each, their ratio, and the
time per token inside the model's layers (`DecoderModel.forward`, the LM head excluded). The
outputs of the two must be the same tokens (the loop changes no bits): a difference stops it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.models import decoder, layer_loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speculative-model", default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    layers_time: dict[str, float] = defaultdict(float)
    forward = decoder.DecoderModel.forward

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = forward(self, *a, **kw)
        layers_time[os.environ["DEEPINFER_LAYER_LOOP"]] += time.perf_counter() - t0
        return out

    decoder.DecoderModel.forward = timed
    spec = {} if args.speculative_model is None else {"speculative_model": args.speculative_model,
                                                      "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(args.model, max_model_len=1024, enable_prefix_caching=False, num_threads=args.threads, **spec)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {"0": [], "1": []}
    first = None
    for r in range(args.rounds):
        switch = "1" if r % 2 else "0"
        os.environ["DEEPINFER_LAYER_LOOP"] = switch
        layer_loop.loop_enabled.cache_clear()
        t0 = time.perf_counter()
        tokens = llm.generate([[1] + list(range(100, 140))], params, use_tqdm=False)[0].outputs[0].token_ids
        wall = time.perf_counter() - t0
        first = first or tokens
        if tokens != first:
            raise SystemExit(f"round {r}: the outputs differ with DEEPINFER_LAYER_LOOP={switch}")
        if r >= 2:
            rates[switch].append(args.tokens / wall)
        else:  # a warm-up round
            layers_time[switch] = 0.0
    llm.close()
    counted = (args.rounds - 2) // 2
    for switch, name in (("0", "modules"), ("1", "layer loop")):
        per_token = layers_time[switch] / (counted * args.tokens) * 1e3
        print(f"{name:10s}  {statistics.median(rates[switch]):7.2f} tok/s (median of {len(rates[switch])}), "
              f"layers {per_token:.2f} ms/token")
    print(f"layer loop / modules: {statistics.median(rates['1']) / statistics.median(rates['0']):.3f}x")


if __name__ == "__main__":
    main()
