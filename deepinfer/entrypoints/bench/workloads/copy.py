"""The copy workload: answers that repeat or edit text of the prompt, with and without speculation.

Eight requests ask the model to repeat a paragraph, rename a variable, fix typos in a list and
the like, on a few hundred tokens of fixed text (`COPY_TASKS`), wrapped in the model's chat
template when it has one. Most of each answer is a copy of the prompt, so prompt lookup (ngram)
drafts can be accepted. Greedy, EOS honoured, outputs capped at --max-tokens (default 128);
tok/s counts the tokens actually produced. A model without a tokenizer (`--load-format dummy`)
gets token-id prompts whose tail starts a span repeated from earlier in the prompt, with
ignore_eos and fixed output lengths (random weights seldom continue the span, so drafts come
mostly from the loops such a model falls into).

One invocation runs the same requests on two engines built one after the other (the first is
dropped before the second is built): plain decoding (`deepinfer`) and speculative decoding
(`deepinfer+ngram`, or the --speculative-method given, with --num-speculative-tokens), each at
batch 1 (one request at a time) and batch 8 (all at once), after one warm-up request. Per batch
it prints (the acceptance from the engine's counters over that measured run only):

    copy     deepinfer       batch  1    512 tokens in   ... s =   ... tok/s
    copy     deepinfer+ngram batch  1    512 tokens in   ... s =   ... tok/s
    copy     deepinfer+ngram batch 1: acceptance rate 0.538 (347 of 645 draft tokens), mean
             accepted length 3.57 over 135 verification steps                       (one line)
    copy     batch 1 deepinfer+ngram / deepinfer: 1.92x
    copy     batch 1 outputs deepinfer+ngram vs deepinfer: identical (8 of 8 requests)

Greedy speculative decoding must give plain decoding's tokens; a mismatch is printed with the
requests and token positions where the outputs part.
"""

from __future__ import annotations

import argparse
import gc
import random

from deepinfer.entrypoints.bench.common import BenchResult, Workload, engine_label, measure
from deepinfer.entrypoints.bench.report import format_result, format_spec
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 128
DEFAULT_METHOD = "ngram"
BATCH_SIZES = (1, 8)

Run = tuple[BenchResult, list[list[int]]]  # a measured run and each request's output token ids

COPY_TASKS = (
    "Repeat the following paragraph exactly, word for word:\n\n"
    "The lighthouse on the northern cape was built in 1874 from granite quarried a few miles inland. "
    "For more than a century its keepers climbed the one hundred and twelve steps of the spiral "
    "staircase every evening to light the lamp, wind the clockwork that turned the lens, and record "
    "the weather in a leather-bound logbook. In storms the spray reached the gallery windows, and "
    "the keepers would stay awake through the night, watching for ships in distress. The light was "
    "automated in 1989, and the keepers' cottage is now a small museum where visitors can read the "
    "old logbooks, see the original brass lamp, and look out over the same rocks that the keepers "
    "watched for so many years.",
    "Rename the variable `x` to `total` in this code and print the whole code again:\n\n"
    "def summarize(orders):\n    x = 0\n    count = 0\n    for order in orders:\n"
    "        if order.status == 'cancelled':\n            continue\n        x += order.price * order.quantity\n"
    "        count += 1\n    if count == 0:\n        return {'x': 0, 'mean': 0.0}\n"
    "    mean = x / count\n    print(f'{count} orders, x = {x:.2f}, mean = {mean:.2f}')\n"
    "    return {'x': x, 'mean': mean}\n\n\n"
    "def report(orders_by_day):\n    for day, orders in sorted(orders_by_day.items()):\n"
    "        x = summarize(orders)['x']\n        print(day, x)\n",
    "Copy this list and fix the typos:\n\n"
    "1. Two cups of flower\n2. A teaspon of baking soda\n3. Half a cup of suger\n4. Three eggs, "
    "beatten\n5. One cup of milk, warmed\n6. A pinch of salt\n7. Two tablespons of butter, melted\n"
    "8. One teaspoon of vanila extract\n9. A handfull of blueberries\n10. The zest of one lemmon\n"
    "11. Half a cup of choped walnuts\n12. A little oil for the pann\n13. Maple sirup to serve\n"
    "14. Fresh mint leafs to garnish\n15. A bowl of whiped cream\n",
    "Repeat this email exactly, but change the meeting day from Monday to Friday:\n\n"
    "Hello team,\n\nThank you all for your hard work on the quarterly report. Before we send it to "
    "the board, I would like us to meet once more to review the figures in the third section and "
    "agree on the wording of the summary. The meeting will take place on Monday at ten o'clock in "
    "the large conference room on the second floor. Please bring your notes and any changes you "
    "would like to propose. If you cannot attend on Monday, let me know by the end of today so that "
    "we can find another way to include your comments. Coffee and pastries will be provided.\n\n"
    "Best regards,\nMaria",
    "Copy this JSON and rename the key \"name\" to \"title\" everywhere; change nothing else:\n\n"
    '[\n  {"id": 1, "name": "The Old Man and the Sea", "author": "Ernest Hemingway", "year": 1952},\n'
    '  {"id": 2, "name": "Pride and Prejudice", "author": "Jane Austen", "year": 1813},\n'
    '  {"id": 3, "name": "One Hundred Years of Solitude", "author": "Gabriel Garcia Marquez", "year": 1967},\n'
    '  {"id": 4, "name": "The Great Gatsby", "author": "F. Scott Fitzgerald", "year": 1925},\n'
    '  {"id": 5, "name": "Moby-Dick", "author": "Herman Melville", "year": 1851},\n'
    '  {"id": 6, "name": "War and Peace", "author": "Leo Tolstoy", "year": 1869},\n'
    '  {"id": 7, "name": "Things Fall Apart", "author": "Chinua Achebe", "year": 1958},\n'
    '  {"id": 8, "name": "Beloved", "author": "Toni Morrison", "year": 1987}\n]',
    "Repeat the following steps exactly, keeping the numbers:\n\n"
    "1. Unplug the printer and wait for thirty seconds.\n2. Open the front cover and remove the "
    "toner cartridge.\n3. Gently shake the cartridge from side to side five or six times.\n4. Check "
    "the paper path for torn pieces of paper and remove them.\n5. Put the cartridge back until it "
    "clicks into place.\n6. Close the front cover.\n7. Plug the printer in and switch it on.\n8. Wait "
    "until the green light stops blinking.\n9. Print a test page from the settings menu.\n10. If the "
    "test page is still streaked, repeat steps one to nine once more, and then call the help desk "
    "on extension 4417.\n",
    "Rewrite this paragraph with American spelling (colour -> color and so on); keep everything else:\n\n"
    "The neighbourhood centre organised a festival to honour the volunteers who had helped during "
    "the flood. The favourite event was a parade in which children in colourful costumes marched "
    "behind a band, and the smell of grilled food filled the air. The organisers had analysed the "
    "weather forecast carefully and travelled to three towns to borrow tents, so that nobody would "
    "be disappointed if it rained. In the evening the mayor thanked everyone for their labour and "
    "their generous behaviour, and she recognised the firefighters whose skilful work had saved the "
    "old theatre. The festival ended with music and dancing until well after midnight.",
    "Copy this code and rename the function `calc` to `compute_mean`, including where it is called:\n\n"
    "import statistics\n\n\ndef calc(values):\n    \"\"\"Return the arithmetic mean of values.\"\"\"\n"
    "    if not values:\n        raise ValueError('calc needs at least one value')\n"
    "    return sum(values) / len(values)\n\n\n"
    "def describe(values):\n    mean = calc(values)\n    spread = statistics.pstdev(values)\n"
    "    return f'mean {mean:.3f}, spread {spread:.3f}, n = {len(values)}'\n\n\n"
    "if __name__ == '__main__':\n    data = [3.5, 4.25, 5.0, 2.75, 4.5, 3.0]\n"
    "    print(calc(data))\n    print(describe(data))\n",
)


def copy_workload(llm, max_tokens: int | None) -> Workload:
    """The eight copy requests for `llm`'s model: its tokenizer and chat template when it has a
    tokenizer, else token-id prompts with a repeated span (ignore_eos, fixed output lengths)."""
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        prompts = repeated_span_prompts(llm.engine.source.hf_config.vocab_size, len(COPY_TASKS))
        return Workload("copy", prompts, [max_tokens] * len(prompts))
    prompts = [_encode(llm, tokenizer, text) for text in COPY_TASKS]
    return Workload("copy", prompts, [max_tokens] * len(prompts), ignore_eos=False)


def _encode(llm, tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        return llm.apply_chat_template([{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def repeated_span_prompts(vocab_size: int, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts `head + span + middle + span[:8]`: the tail starts a 96-token span seen
    earlier, so prompt lookup finds a continuation to draft from."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    prompts = []
    for _ in range(num_prompts):
        span = draw(96)
        prompts.append(draw(32) + span + draw(64) + span[:8])
    return prompts


def run_copy(args) -> list[BenchResult]:
    """Plain, then speculative decoding of the copy requests, each at batch 1 and 8; prints and
    returns their results (the speculative ones carry `spec` and `vs_plain`)."""
    method = args.speculative_method or DEFAULT_METHOD
    workload, runs = None, {}
    for speculative_method in (None, method):
        with make_llm(_engine_args(args, speculative_method)) as llm:  # closed (its ranks stopped) before the next
            workload = workload or copy_workload(llm, args.max_tokens)
            runs[speculative_method] = _run_engine(llm, workload, engine_label(speculative_method))
        del llm
        gc.collect()
    return _compare(runs[None], runs[method])


def _engine_args(args, speculative_method: str | None) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))
    ns.speculative_method = speculative_method
    ns.max_num_seqs = max(args.max_num_seqs, max(BATCH_SIZES))
    return ns


def _run_engine(llm, workload: Workload, engine: str) -> list[Run]:
    """A warm-up (the first prompt, 8 tokens), then the workload at each batch size."""
    llm.generate(workload.prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    runs = []
    for batch in BATCH_SIZES:
        result, token_ids = measure(llm, workload, engine, batch)
        print(format_result(result), flush=True)
        if result.spec is not None:
            print(format_spec(result), flush=True)
        runs.append((result, token_ids))
    return runs


def _compare(plain: list[Run], spec: list[Run]) -> list[BenchResult]:
    """Per batch size: the speed ratio and whether the greedy outputs agree token for token."""
    for (p, p_ids), (s, s_ids) in zip(plain, spec, strict=True):
        mismatches = {i: _first_difference(a, b) for i, (a, b) in enumerate(zip(p_ids, s_ids, strict=True))
                      if a != b}
        s.vs_plain = {"speedup": s.tokens_per_s / p.tokens_per_s, "identical_outputs": not mismatches,
                      "mismatched_requests": sorted(mismatches)}
        print(f"{s.workload:8s} batch {s.batch} {s.engine} / {p.engine}: {s.vs_plain['speedup']:.2f}x", flush=True)
        print(f"{s.workload:8s} batch {s.batch} outputs {s.engine} vs {p.engine}: "
              + _agreement(mismatches, len(p_ids)), flush=True)
    return [r for r, _ in plain + spec]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _agreement(mismatches: dict[int, int], num_requests: int) -> str:
    if not mismatches:
        return f"identical ({num_requests} of {num_requests} requests)"
    where = ", ".join(f"request {i} from token {t}" for i, t in sorted(mismatches.items()))
    return f"MISMATCH in {len(mismatches)} of {num_requests} requests ({where})"
