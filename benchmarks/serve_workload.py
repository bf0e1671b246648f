"""The mixed serving workload of benchmarks/benchmark_serve_mixed.py, the client that sends it to a server's
`/v1/completions` (streamed), and its statistics, as vLLM's serving benchmark (`vllm bench serve`) defines them; pure
Python (httpx is imported only to send), so that tests can check the workload and statistics on fixed inputs.

Workload: `count` requests whose prompt and answer lengths are drawn uniformly from
[mean * (1 - range_ratio), mean * (1 + range_ratio)] (vLLM's random dataset), arriving at `rate` requests per second
as a Poisson process (exponential gaps; `burstiness` != 1 gives gamma-distributed gaps of the same mean, as vLLM's
`--burstiness`), or all at once for an infinite rate. Everything is drawn from one seeded generator, so every server
gets the same requests at the same offsets.

Statistics of one run (`summarize`): output throughput (generated tokens over the run's duration: first request sent
to last answer completed), request throughput, time to first token (request sent to first content chunk), inter-token
latency (the gaps between consecutive content chunks of a stream, pooled over streams) and time per output token
(per request: (last chunk - first chunk) / (tokens - 1)), each at its median and 95th percentile (linear
interpolation between order statistics, numpy's default).
"""

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload: its prompt (token ids of the corpus, and their text), the answer length asked
    for, and when it is sent (seconds after the run starts)."""

    prompt_ids: tuple[int, ...]
    output_len: int
    offset: float


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: [floor(mean * (1 - r)), ceil(mean * (1 + r))], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError("range_ratio must be in [0, 1).")
    return max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))


def arrival_offsets(rng: random.Random, count: int, rate: float, burstiness: float = 1.0) -> list[float]:
    """When each of `count` requests is sent, in seconds from the start: 0 for the first, then gaps drawn from a
    gamma distribution of mean 1 / rate and shape `burstiness` (1: exponential, a Poisson process). An infinite rate
    sends everything at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive.")
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        offsets.append(now)
    return offsets


def make_workload(
    corpus_ids: list[int],
    count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rate: float,
    seed: int,
    burstiness: float = 1.0,
) -> list[WorkItem]:
    """`count` requests: prompt lengths around `input_len` and answer lengths around `output_len` (see
    `length_bounds`), each prompt a window of the token stream `corpus_ids` at a random start, sent at
    `arrival_offsets`. The same seed gives the same requests at every rate (the arrival gaps come from a generator
    of their own), so the rates differ only in timing."""
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    if len(corpus_ids) < in_high:
        raise ValueError(f"the corpus has {len(corpus_ids)} tokens, fewer than the longest prompt ({in_high}).")
    rng = random.Random(seed)
    input_lens = [rng.randint(in_low, in_high) for _ in range(count)]
    output_lens = [rng.randint(out_low, out_high) for _ in range(count)]
    starts = [rng.randrange(len(corpus_ids) - length + 1) for length in input_lens]
    offsets = arrival_offsets(random.Random(seed + 1), count, rate, burstiness)
    return [
        WorkItem(tuple(corpus_ids[start : start + length]), out_len, offset)
        for start, length, out_len, offset in zip(starts, input_lens, output_lens, offsets)
    ]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks (numpy's default); NaN for
    no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class RequestRecord:
    """What the client saw of one streamed request: when it was sent, when each content chunk arrived (seconds on
    one clock), how many tokens the server says it generated, and an error if it failed."""

    sent: float
    chunks: list[float]
    output_tokens: int
    expected_tokens: int
    prompt_tokens: int = 0
    error: str | None = None


def summarize(records: list[RequestRecord]) -> dict:
    """The figures of one run (see the module's docstring); times in seconds, latencies in milliseconds."""
    done = [record for record in records if record.error is None and record.chunks]
    summary: dict = {"requests": len(records), "completed": len(done), "failed": len(records) - len(done)}
    if not done:
        return summary
    start = min(record.sent for record in records)
    end = max(record.chunks[-1] for record in done)
    duration = end - start
    tokens = sum(record.output_tokens for record in done)
    ttft = [1000 * (record.chunks[0] - record.sent) for record in done]
    itl = [1000 * (b - a) for record in done for a, b in zip(record.chunks, record.chunks[1:])]
    tpot = [
        1000 * (record.chunks[-1] - record.chunks[0]) / (record.output_tokens - 1)
        for record in done
        if record.output_tokens > 1
    ]
    summary.update(
        duration_s=duration,
        output_tokens=tokens,
        prompt_tokens=sum(record.prompt_tokens for record in done),
        length_mismatches=sum(record.output_tokens != record.expected_tokens for record in done),
        output_throughput=tokens / duration,
        request_throughput=len(done) / duration,
    )
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot)):
        summary[name] = {"mean": sum(values) / len(values) if values else math.nan}
        summary[name].update({f"p{q}": percentile(values, q) for q in (50, 95)})
    return summary


# ------------------------------------------------------------------------------------------------ client


async def one_request(http, model: str, text: str, item, prompt_tokens: int, fixed_length: dict, start: float):
    await asyncio.sleep(max(0.0, start + item.offset - time.perf_counter()))
    body = {"model": model, "prompt": text, "max_tokens": item.output_len, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body.update({key: item.output_len if value is None else value for key, value in fixed_length.items()})
    record = RequestRecord(time.perf_counter(), [], 0, item.output_len, prompt_tokens)
    usage = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices") and event["choices"][0].get("text"):
                    record.chunks.append(time.perf_counter())
    except Exception as error:  # a failed request is counted as such, the run goes on
        record.error = f"{type(error).__name__}: {error}"
    record.output_tokens = usage["completion_tokens"] if usage else len(record.chunks)
    return record


async def run_workload(url: str, model: str, items, texts, prompt_counts, fixed_length: dict) -> list[RequestRecord]:
    import httpx

    limits = httpx.Limits(max_connections=len(items) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        return await asyncio.gather(
            *(
                one_request(http, model, text, item, count, fixed_length, start)
                for item, text, count in zip(items, texts, prompt_counts)
            )
        )
