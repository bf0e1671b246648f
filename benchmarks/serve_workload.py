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

Structured-output mix (`with_structured_share`): the same requests, a share of them (chosen by a seeded generator)
carrying a JSON schema in vLLM's `structured_outputs` field, so a server is measured with and without the mix on the
same prompts, lengths and arrival times:

    items = make_workload(corpus_ids, 24, 128, 64, 0.5, rate=8, seed=0)
    mixed = with_structured_share(items, 0.5, seed=0, schema=structured_schema(96))
    request_body("vaswani-int8", text, mixed[0], {"ignore_eos": True})   # what one_request posts
"""

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload: its prompt (token ids of the corpus, and their text), the answer length asked
    for, when it is sent (seconds after the run starts), and the JSON schema its answer must satisfy (None: free
    text)."""

    prompt_ids: tuple[int, ...]
    output_len: int
    offset: float
    schema: dict | None = None


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


def structured_schema(keywords: int) -> dict:
    """The JSON schema of the structured-output mix: an object with a short summary and exactly `keywords` keywords
    (strings of 1 to 16 characters). Each keyword takes at least one token, so with `keywords` at the longest answer
    length (`length_bounds(...)[1]`) no valid answer ends before its `max_tokens`: a constrained answer has its drawn
    length, as a plain one has under `ignore_eos` (which cannot lengthen an answer past its grammar's end), and both
    mixes generate the same number of tokens. One schema for the whole run: the server compiles it once."""
    return {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "maxLength": 48},
            "keywords": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 16},
                "minItems": keywords,
                "maxItems": keywords,
            },
        },
        "required": ["summary", "keywords"],
        "additionalProperties": False,
    }


def with_structured_share(items: list[WorkItem], share: float, seed: int, schema: dict) -> list[WorkItem]:
    """`items` with round(share * len(items)) of them, drawn without replacement by a generator seeded with `seed`
    (one of its own, so the prompts and arrivals stay those of `make_workload`), carrying `schema`."""
    if not 0 <= share <= 1:
        raise ValueError(f"the structured share is a fraction of the requests, in [0, 1]; got {share}.")
    chosen = set(random.Random(seed + 2).sample(range(len(items)), round(share * len(items))))
    return [replace(item, schema=schema) if index in chosen else item for index, item in enumerate(items)]


def request_body(model: str, text: str, item: WorkItem, fixed_length: dict) -> dict:
    """The `/v1/completions` body of one request: streamed, greedy, usage in the last chunk, the engine's fields
    that fix the answer's length (`fixed_length`; a None value is filled with the answer length), and the item's
    schema as vLLM's `structured_outputs: {"json": schema}` (vaswani serve and vLLM take it)."""
    body = {"model": model, "prompt": text, "max_tokens": item.output_len, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body.update({key: item.output_len if value is None else value for key, value in fixed_length.items()})
    if item.schema is not None:
        body["structured_outputs"] = {"json": item.schema}
    return body


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
    one clock), how many tokens the server says it generated, an error if it failed, whether it carried a schema,
    why its answer ended and its text."""

    sent: float
    chunks: list[float]
    output_tokens: int
    expected_tokens: int
    prompt_tokens: int = 0
    error: str | None = None
    structured: bool = False
    finish_reason: str | None = None
    text: str = ""


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


def kind_summaries(records: list[RequestRecord]) -> dict:
    """`summarize` of the requests with a schema and of those without, apart (their latencies; the throughput is the
    whole run's), with how the structured answers ended and how many of those that ended with "stop" parse as
    JSON."""
    structured = [record for record in records if record.structured]
    summaries = {"structured": summarize(structured), "plain": summarize([r for r in records if not r.structured])}
    reasons: dict[str, int] = {}
    for record in structured:
        reasons[str(record.finish_reason)] = reasons.get(str(record.finish_reason), 0) + 1
    summaries["structured"]["finish_reasons"] = reasons
    summaries["structured"]["stopped_and_parsed"] = sum(
        record.finish_reason == "stop" and parses_as_json(record.text) for record in structured
    )
    return summaries


def parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def run_entry(records: list[RequestRecord], **labels) -> dict:
    """One measured run as the results JSON keeps it: `labels` (round, engine, rate, ...), the summary, the first
    errors, and every request's times in seconds from the run's first request, to 0.1 ms (the file stays small)."""
    zero = records[0].sent
    return {
        **labels,
        "summary": summarize(records),
        "errors": [record.error for record in records if record.error][:5],
        "requests": [
            {
                "sent": round(record.sent - zero, 4),
                "chunks": [round(chunk - zero, 4) for chunk in record.chunks],
                "output_tokens": record.output_tokens,
                "expected_tokens": record.expected_tokens,
                "prompt_tokens": record.prompt_tokens,
                "error": record.error,
                **({"structured": True, "finish_reason": record.finish_reason} if record.structured else {}),
            }
            for record in records
        ],
    }


async def one_request(http, model: str, text: str, item, prompt_tokens: int, fixed_length: dict, start: float):
    await asyncio.sleep(max(0.0, start + item.offset - time.perf_counter()))
    body = request_body(model, text, item, fixed_length)
    record = RequestRecord(time.perf_counter(), [], 0, item.output_len, prompt_tokens, structured=bool(item.schema))
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
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text"):
                    record.chunks.append(time.perf_counter())
                    record.text += choice["text"]
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
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


def server_seconds(url: str) -> dict:
    """A vaswani server's seconds in each part of its scheduler loop so far (`GET /health` -> "seconds": prefill,
    decode, sampling, and grammar: waiting for the masks after each step); {} from a server without them."""
    import httpx

    body = httpx.get(url + "/health", timeout=10).json()
    return body.get("seconds", {}) if isinstance(body, dict) else {}


def seconds_between(before: dict, after: dict) -> dict:
    """The seconds each part took between two `server_seconds` readings."""
    return {part: round(after[part] - before.get(part, 0.0), 4) for part in after}
