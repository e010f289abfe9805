"""Prefix-cache hit rate of a data-parallel front end's routing against random placement.

    deepinfer serve --data-parallel-size 2 --port 8000 &
    python scripts/dp_prefix_hits.py --url http://127.0.0.1:8000 --groups 8 --per-group 6

Sends `groups` x `per-group` completions through the front end (each group shares a long prefix,
each request adds its own question), then as many again, with other prefixes, each straight to a
replica drawn at random (the replicas' addresses come from /dp/replicas). The hit rate of each half
is the prompt tokens found in the replicas' prefix caches over the prompt tokens looked up (the
replicas' /metrics, summed). Requests are sent one at a time, so placement alone decides.
"""

from __future__ import annotations

import argparse
import random
import re

import httpx

_WORDS = ("amber basalt cedar delta ember fjord granite harbor indigo juniper kelp lagoon meadow nectar "
          "orchid prairie quartz river saffron tundra umber valley willow xenon yarrow zephyr").split()


def prefix(group: int, words: int) -> str:
    rng = random.Random(group)
    return f"Notes for group {group}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = {"queries": 0.0, "hits": 0.0}
    for name, value in re.findall(r"^deepinfer_prefix_cache_(queries|hits)_total\{[^}]*\} (\S+)$", text, re.M):
        total[name] += float(value)
    return total["queries"], total["hits"]


def send(url: str, prompt: str) -> None:
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                        timeout=120)
    answer.raise_for_status()


def hit_rate(front: str, targets, groups: range, per_group: int, words: int) -> float:
    before = counters(front)
    for group in groups:
        for i in range(per_group):
            send(targets(), f"{prefix(group, words)}\nQuestion {i}: what comes next?")
    after = counters(front)
    return (after[1] - before[1]) / max(1.0, after[0] - before[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the front end")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    urls = [r["url"] for r in httpx.get(f"{args.url}/dp/replicas", timeout=10).json()["replicas"] if r["up"]]
    rng = random.Random(args.seed)
    routed = hit_rate(args.url, lambda: args.url, range(args.groups), args.per_group, args.prefix_words)
    scattered = hit_rate(args.url, lambda: rng.choice(urls), range(args.groups, 2 * args.groups),
                         args.per_group, args.prefix_words)
    print(f"replicas up: {len(urls)}; {args.groups} prefixes x {args.per_group} requests each")
    print(f"prefix-cache hit rate, routed by the front end: {routed:.3f}")
    print(f"prefix-cache hit rate, random placement:        {scattered:.3f}")


if __name__ == "__main__":
    main()
