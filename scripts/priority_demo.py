"""32 low-priority requests (priority 10), then half a second later one high-priority request
(priority 0), against a running `deepinfer serve`; prints where the high one finished and when.

    deepinfer serve --port 8510 --scheduling-policy priority --max-num-seqs 8 &
    python scripts/priority_demo.py http://127.0.0.1:8510 priority     # or: ... fcfs (no priority sent)
"""
import asyncio
import sys
import time

import httpx

URL = sys.argv[1]
PRIO = sys.argv[2] == "priority"

async def one(client, name, prio, done):
    body = {"prompt": f"Request {name}: tell a story about the sea.", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    if PRIO:
        body["priority"] = prio
    t = time.monotonic()
    r = await client.post(f"{URL}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    done.append((name, time.monotonic() - t))

async def main():
    done = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        low = [asyncio.create_task(one(client, f"low{i}", 10, done)) for i in range(32)]
        await asyncio.sleep(0.5)
        high = asyncio.create_task(one(client, "HIGH", 0, done))
        await asyncio.gather(*low, high)
    order = [n for n, _ in done]
    print(f"policy {'priority' if PRIO else 'fcfs'}: HIGH finished {order.index('HIGH') + 1} of {len(order)}, "
          f"in {dict(done)['HIGH']:.2f} s; the low ones' mean {sum(t for n, t in done if n != 'HIGH') / 32:.2f} s")

asyncio.run(main())
