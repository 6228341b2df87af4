"""A small open-loop HTTP/1.1 load generator (its own process, uvloop, keep-alive connections).

Requests are scheduled at a fixed rate; each is sent on the next free connection and its latency is
counted from its *scheduled* time, so a server (or this generator) that falls behind shows it in the
latencies instead of silently lowering the rate (coordinated omission). Prints one JSON object.

    python -m bench.http_load http://127.0.0.1:8080 --rate 500 --seconds 20 --keys 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from urllib.parse import urlsplit

PATH = "/v1/pipelines/offers/views/merchant_offers_hourly/keys/merchant-{:04d}"


async def run(url: str, rate: int, seconds: float, connections: int, keys: int) -> dict:
    parts = urlsplit(url)
    queue: asyncio.Queue = asyncio.Queue()
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    rng = random.Random(11)

    # perf_counter, not loop.time(): uvloop's clock counts whole milliseconds.
    async def pace() -> None:
        start = time.perf_counter() + 0.05
        for i in range(int(rate * seconds)):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            queue.put_nowait((due, PATH.format(rng.randrange(keys))))
        for _ in range(connections):
            queue.put_nowait(None)

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        while (item := await queue.get()) is not None:
            due, path = item
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            status = int(head[9:12])
            statuses[status] = statuses.get(status, 0) + 1
            latencies.append(time.perf_counter() - due)
        writer.close()

    began = time.perf_counter()
    await asyncio.gather(pace(), *[connection() for _ in range(connections)])
    elapsed = time.perf_counter() - began
    ordered = sorted(latencies)

    def pct(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000, 2)

    return {
        "requests": len(ordered), "per_s": round(len(ordered) / elapsed), "offered_per_s": rate,
        "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0), "statuses": statuses,
        "connections": connections,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url")
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(run(args.url, args.rate, args.seconds, args.connections, args.keys))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
