"""`deepinfer bench`: throughput on fixed workloads, optionally beside peers in the same run.

Workloads (same requests for every engine):
  cpu32   32 requests, prompt lengths U[32, 256] of random token ids, output lengths U[32, 256],
          seed 0, greedy, ignore_eos; reports useful output tokens per second.
  decode1 one request, a short prompt, 128 output tokens; reports tokens per second.
  long    16 requests of 2,048-token prompts and 256 outputs, run twice on the same model: with a
          sliding window of W = --window (128) on every layer, and with the full cache. Reports
          tokens/s of each and the KV bytes allocated per request against the formula S / L.

Prompts are token ids, so a model without tokenizer files runs too (`--load-format dummy` on a
bare config.json). `--max-tokens N` caps each request's output length (default: as drawn) and
`--num-requests` sets cpu32's request count; the prompts stay the same.

`--peer hf` / `--peer llama.cpp` run the same requests in a peer after ours, and the ratios are
printed. With `--load-format dummy` only DeepSeek-V4 has a peer: `--peer hf` runs transformers'
DeepseekV4ForCausalLM on our engine's own dummy weights, after our workloads and with our engine
dropped, one request at a time (`hf-batch1`; see bench_peers).

A model with compressed cache groups (DeepSeek-V4) also gets `kv` lines: each group's bytes from
the engine's allocation units against the formula from its config, per layer type

    window ring (every layer)   S * row_bytes per request, fixed (S = W + allowance, 134 for W = 128)
    CSA / HCA compressed rows   row_bytes / m per token (m = 4 / 128)
    CSA index keys              index_row_bytes / m per token
    compressor state            fp32, per request: CSA 6 * m * (D + D_index) * 4, HCA 2 * m' * D * 4

and the payload at L = max_model_len by the book's formulas (visible rows only).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

from deepinfer.sampling_params import SamplingParams

WORKLOADS = ("cpu32", "decode1", "long")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class BenchResult:
    engine: str
    workload: str
    seconds: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(name: str, vocab_size: int, num_requests: int = 32, seed: int = 0,
                  max_output_len: int | None = None) -> Workload:
    """The workload's token-id prompts and output lengths; `max_output_len` caps the outputs of
    cpu32 and decode1 (the prompts and the other draws stay the same)."""
    rng = random.Random(seed)
    cap = (lambda n: n) if max_output_len is None else (lambda n: min(n, max_output_len))
    if name == "cpu32":
        lens = [(rng.randint(32, 256), rng.randint(32, 256)) for _ in range(num_requests)]
        prompts = [[rng.randrange(100, vocab_size) for _ in range(p)] for p, _ in lens]
        return Workload(name, prompts, [cap(o) for _, o in lens])
    if name == "decode1":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(8)]], [cap(128)])
    if name == "long":
        return Workload(name, [[rng.randrange(100, vocab_size) for _ in range(2048)] for _ in range(16)],
                        [256] * 16)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def run_deepinfer(llm, workload: Workload, engine: str = "deepinfer") -> BenchResult:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"deepinfer produced {produced} tokens, expected {workload.num_output_tokens}")
    return BenchResult(engine, workload.name, seconds, produced)


def add_bench_args(p) -> None:
    p.add_argument("--workload", action="append", choices=WORKLOADS, default=None,
                   help="workload to run (repeatable; default: all)")
    p.add_argument("--num-requests", type=int, default=32, help="requests in cpu32")
    p.add_argument("--peer", action="append", choices=["hf", "llama.cpp"], default=[],
                   help="also run a peer on the same requests (repeatable)")
    p.add_argument("--window", type=int, default=128, help="sliding window W of the long workload")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def run_bench(args) -> int:
    from deepinfer.entrypoints.cli import make_llm

    names = args.workload or ["cpu32", "decode1"]
    max_tokens = getattr(args, "max_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    dummy_peer = bool(args.peer) and getattr(args, "load_format", "auto") == "dummy"
    if dummy_peer:
        check_dummy_peers(args)
    results = []
    if "long" in names:
        from deepinfer.entrypoints.bench_long import run_long

        results += run_long(args, make_workload)
        names = [n for n in names if n != "long"]
    llm = make_llm(args) if names else None
    if llm is not None:
        for line in kv_lines(llm):
            print(line, flush=True)
    workloads = []
    for name in names:
        workload = make_workload(name, llm.engine.source.hf_config.vocab_size, args.num_requests,
                                 max_output_len=max_tokens)
        results.append(run_deepinfer(llm, workload))
        _print(results[-1])
        if name == "cpu32" and has_compressed_groups(llm.engine.runner):
            print(workload_kv_line(llm.engine.runner, workload), flush=True)
        workloads.append(workload)
        for peer in [] if dummy_peer else args.peer:
            from deepinfer.entrypoints.bench_peers import run_peer

            results.append(run_peer(peer, llm.engine.source, workload))
            _print(results[-1])
    if dummy_peer and workloads:
        results += run_dummy_v4_peer(llm, workloads)
        del llm
    _print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], f, indent=2)
    return 0


def check_dummy_peers(args) -> None:
    """Dummy weights have a peer only for DeepSeek-V4 in transformers (`--peer hf`), which then
    runs our engine's own weights; any other model or peer needs the checkpoint's weights."""
    from deepinfer.entrypoints.bench_peers import V4_MODEL_TYPE
    from deepinfer.model_executor.loader import load_model_source

    model_type = getattr(load_model_source(args.model, load_format="dummy").hf_config, "model_type", None)
    if model_type != V4_MODEL_TYPE or set(args.peer) != {"hf"}:
        raise ValueError(f"--peer {' '.join(args.peer)} runs the checkpoint's weights, which load_format='dummy' "
                         f"does not read (with dummy weights only a {V4_MODEL_TYPE} model has a peer: --peer hf, "
                         f"which reuses the engine's weights); model_type is {model_type!r}")


def run_dummy_v4_peer(llm, workloads: list[Workload]) -> list[BenchResult]:
    """transformers' DeepseekV4ForCausalLM on our engine's dummy weights, after our runs: the
    weights are taken over (no copy: the state dict shares their storage), the engine is dropped
    (its KV cache freed) and the HF model is assembled on the meta device around them, so that a
    full-width model is never held twice. Measured one request at a time (batch 1): transformers'
    left-padded batches are not a valid V4 reference (compressor windows align to tensor index 0).
    `llm` is left without its engine."""
    import gc

    from deepinfer.entrypoints.bench_peers import hf_v4_model, hf_v4_state_dict, run_peer

    hf_config = llm.engine.source.hf_config
    state = hf_v4_state_dict(llm.engine.runner.model)
    llm.engine = None  # the caller's reference keeps only an empty shell
    gc.collect()
    model = hf_v4_model(hf_config, state)
    del state
    print("peer     hf-batch1: transformers DeepseekV4ForCausalLM on the engine's dummy weights (fp32, eager), "
          "one request at a time: its left-padded batches are not a valid V4 reference", flush=True)
    results = []
    for workload in workloads:
        results.append(run_peer("hf", None, workload, model=model))
        _print(results[-1])
    return results


def _print(r: BenchResult) -> None:
    print(f"{r.workload:8s} {r.engine:10s} {r.output_tokens:6d} tokens in {r.seconds:8.2f} s "
          f"= {r.tokens_per_s:8.2f} tok/s", flush=True)


def _print_ratios(results: list[BenchResult]) -> None:
    ours = {r.workload: r for r in results if r.engine.startswith("deepinfer")}
    for r in results:
        if not r.engine.startswith("deepinfer"):
            ratio = ours[r.workload].tokens_per_s / r.tokens_per_s
            print(f"{r.workload:8s} deepinfer / {r.engine}: {ratio:.2f}x")


# ---- KV bytes per token of models with compressed groups (DeepSeek-V4) -------------------------

_ROW_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def has_compressed_groups(runner) -> bool:
    return any(g.compress_ratio > 1 for g in runner.groups)


def row_format(elements: int, dtype, kv_cache_dtype: str):
    """The cache_common format of a row of `elements` values: MXFP8, or the compute dtype."""
    from deepinfer.model_executor.layers.ops.cache_common import mxfp8_format, unquantized_format

    return mxfp8_format(elements) if kv_cache_dtype == "fp8" else unquantized_format(elements, _ROW_DTYPES[str(dtype)])


def v4_kv_formula(cfg, dtype, kv_cache_dtype: str) -> dict:
    """The formula's figures from the config alone: {group: (B per token, B per request, text)},
    plus "state" (compressor state per request)."""
    from deepinfer.worker.model_runner import ring_size

    def row(elements: int) -> int:
        return row_format(elements, dtype, kv_cache_dtype).bytes_per_row

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    m, m_hca = cfg.compress_rates[csa], cfg.compress_rates[hca]
    n_layers, n_csa, n_hca = len(cfg.layer_types), cfg.layer_types.count(csa), cfg.layer_types.count(hca)
    d, d_index, s = cfg.head_dim, cfg.index_head_dim, ring_size(cfg.sliding_window)
    latent, index = row(d), row(d_index)
    out = {"swa": (0.0, n_layers * s * latent, f"{n_layers} layers x S {s} x {latent} B")}
    if n_csa:
        out["csa"] = (n_csa * latent / m, 0, f"{n_csa} x {latent} B / {m}")
        out["index"] = (n_csa * index / m, 0, f"{n_csa} x {index} B / {m}")
    if n_hca:
        out["hca"] = (n_hca * latent / m_hca, 0, f"{n_hca} x {latent} B / {m_hca}")
    state = n_csa * 6 * m * (d + d_index) * 4 + n_hca * 2 * m_hca * d * 4
    out["state"] = (0.0, state, f"{n_csa} x 6 x {m} x ({d} + {d_index}) x 4 B + {n_hca} x 2 x {m_hca} x {d} x 4 B")
    return out


def book_payload_bytes(cfg, dtype, kv_cache_dtype: str, num_tokens: int) -> int:
    """The payload of one request at num_tokens tokens by the book's formulas: visible rows only
    (min(L, W) window rows per layer, floor(L / m) compressed rows and index keys per CSA / HCA
    layer), no ring allowance, block padding or compressor state."""
    from deepinfer.model_executor.layers.ops.cache_common import row_payload_bytes, visible_rows

    latent = row_format(cfg.head_dim, dtype, kv_cache_dtype)
    index = row_format(cfg.index_head_dim, dtype, kv_cache_dtype)
    total = 0
    for kind in cfg.layer_types:
        total += row_payload_bytes(visible_rows(num_tokens, cfg.sliding_window), latent)
        if kind in cfg.compress_rates:
            rows = num_tokens // cfg.compress_rates[kind]
            total += row_payload_bytes(rows, latent)
            if kind == "compressed_sparse_attention":
                total += row_payload_bytes(rows, index)
    return total


def kv_lines(llm) -> list[str]:
    """Engine figures (allocation units) per group against the formula, then the book's payload."""
    from deepinfer.entrypoints.info import fmt_bytes, group_bytes

    engine, runner = llm.engine, llm.engine.runner
    cfg = engine.source.hf_config
    if not has_compressed_groups(runner) or not hasattr(cfg, "compress_rates"):
        return []
    kv_dtype = engine.config.cache.kv_cache_dtype
    formula = v4_kv_formula(cfg, runner.dtype, kv_dtype)
    lines, total_token, total_request = [], 0.0, 0
    for g in group_bytes(runner):
        want_token, want_request, text = formula.get(g.name, (None, None, "?"))
        ok = "ok" if (g.per_token, g.per_request) == (want_token, want_request) else "MISMATCH"
        what = (f"{fmt_bytes(g.per_request)} B per request, fixed" if g.kind == "ring" else
                f"{fmt_bytes(g.per_token)} B per token")
        want = (f"{fmt_bytes(want_request)} B" if g.kind == "ring" else f"{fmt_bytes(want_token)} B") \
            if want_token is not None else "none"
        shape = (f"ring of S = {g.rows_per_unit} rows per layer" if g.kind == "ring" else
                 f"1 row per {g.compress_ratio} tokens")
        lines.append(f"kv       {g.name:6s} {g.kind:5s} {g.num_layers} layers, rows of {g.row_bytes:,} B, {shape}: "
                     f"engine {what}; formula {text} = {want} [{ok}]")
        total_token += g.per_token
        total_request += g.per_request
    state, (_, want_state, text) = runner.state_bytes(), formula["state"]
    lines.append(f"kv       state  fp32 compressor state: engine {state:,} B per request; formula {text} = "
                 f"{want_state:,} B [{'ok' if state == want_state else 'MISMATCH'}]")
    lines.append(f"kv       total  {fmt_bytes(total_token)} B per token + {total_request + state:,} B per request "
                 f"(rings {total_request:,} + state {state:,})")
    length = engine.max_model_len
    payload = book_payload_bytes(cfg, runner.dtype, kv_dtype, length)
    dense = len(cfg.layer_types) * row_format(cfg.head_dim, runner.dtype, kv_dtype).bytes_per_row
    lines.append(f"kv       book   payload at L = {length:,} (visible rows: min(L, W) window + floor(L / m) "
                 f"compressed per layer): {payload:,} B = {fmt_bytes(round(payload / length, 3))} B per token; "
                 f"every token's latent row in every layer would be {dense:,} B per token")
    return lines


def workload_kv_line(runner, workload: Workload) -> str:
    """Bytes the engine allocates for the workload's requests at their final lengths (rings,
    block padding and compressor state included), per token."""
    from deepinfer.entrypoints.bench_long import allocated_bytes_per_request
    from deepinfer.entrypoints.info import fmt_bytes

    lengths = [len(p) + o for p, o in zip(workload.prompts, workload.output_lens, strict=True)]
    allocated = sum(allocated_bytes_per_request(runner, n) + runner.state_bytes() for n in lengths)
    return (f"kv       {workload.name:6s} allocated for its {len(lengths)} requests at their final lengths "
            f"({sum(lengths):,} tokens): {allocated:,} B = {fmt_bytes(round(allocated / sum(lengths), 3))} B per token")
