"""The mixed serving benchmark's workload and statistics (benchmarks/serve_workload.py) on fixed inputs, with
expectations derived from the definitions vLLM's serving benchmark uses, and its published results table: the command
it names exists and its JSON parses and holds what the table shows."""

import importlib.util
import json
import math
import random
import re
from pathlib import Path

import numpy
import pytest

from benchmarks import serve_workload as workload

ROOT = Path(__file__).resolve().parent.parent

CORPUS = list(range(10_000))  # token i at position i: a prompt is a window iff its ids are consecutive


def test_lengths_are_drawn_within_the_range_ratio_and_prompts_are_corpus_windows():
    assert workload.length_bounds(128, 0.5) == (64, 192)
    assert workload.length_bounds(10, 0.25) == (7, 13)  # floor(7.5), ceil(12.5)
    assert workload.length_bounds(1, 0.9) == (1, 2)  # never below one token
    items = workload.make_workload(CORPUS, 200, input_len=40, output_len=20, range_ratio=0.5, rate=4, seed=3)
    assert len(items) == 200
    assert {len(item.prompt_ids) for item in items} <= set(range(20, 61))
    assert {item.output_len for item in items} <= set(range(10, 31))
    # Uniform draws over 41 and 21 values: 200 requests reach both ends of each range with near certainty.
    assert min(len(item.prompt_ids) for item in items) < 25 and max(len(item.prompt_ids) for item in items) > 55
    for item in items:
        first = item.prompt_ids[0]
        assert list(item.prompt_ids) == list(range(first, first + len(item.prompt_ids)))


def test_the_same_seed_gives_the_same_requests_at_every_rate_and_infinity_sends_all_at_once():
    def draw(rate, seed=7):
        return workload.make_workload(CORPUS, 50, 32, 16, 0.5, rate, seed)

    at_2, at_8, at_inf = draw(2), draw(8), draw(math.inf)
    assert draw(2) == at_2  # reproducible
    strip = [[(item.prompt_ids, item.output_len) for item in run] for run in (at_2, at_8, at_inf)]
    assert strip[0] == strip[1] == strip[2]  # only the timing differs between rates
    assert draw(2, seed=8) != at_2
    assert [item.offset for item in at_inf] == [0.0] * 50
    offsets = [item.offset for item in at_2]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # Same gaps, drawn from the same generator, scaled by the rate: Poisson gaps at rate 8 are a quarter of rate 2's.
    assert [item.offset for item in at_8] == pytest.approx([offset / 4 for offset in offsets])


def test_arrivals_form_a_poisson_process_at_the_rate_and_burstiness_sets_the_spread():
    count, rate = 20_001, 4.0
    gaps = numpy.diff(workload.arrival_offsets(random.Random(0), count, rate))
    # Exponential gaps: mean 1/rate, standard deviation 1/rate; the sample mean's error is 1/(rate sqrt(n)) = 0.7%.
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # coefficient of variation of an exponential
    # Gamma gaps of shape k keep the mean and have a coefficient of variation of 1/sqrt(k).
    bursty = numpy.diff(workload.arrival_offsets(random.Random(0), count, rate, burstiness=4.0))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(0.5, rel=0.05)


def test_percentiles_interpolate_linearly_like_numpy():
    assert workload.percentile([4, 1, 3, 2], 50) == 2.5
    assert workload.percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)  # rank 0.95 * 3 = 2.85
    assert workload.percentile([5.0], 95) == 5.0
    assert math.isnan(workload.percentile([], 50))
    values = [random.Random(1).expovariate(1.0) for _ in range(101)]
    for q in (0, 5, 50, 95, 99, 100):
        assert workload.percentile(values, q) == pytest.approx(numpy.percentile(values, q))


def test_summary_of_fixed_streams():
    Record = workload.RequestRecord
    records = [
        Record(sent=0.0, chunks=[1.0, 1.5, 2.0], output_tokens=3, expected_tokens=3, prompt_tokens=10),
        Record(sent=0.5, chunks=[2.5, 3.5], output_tokens=2, expected_tokens=4, prompt_tokens=20),
        Record(sent=0.2, chunks=[], output_tokens=0, expected_tokens=5, error="500: boom"),
    ]
    summary = workload.summarize(records)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 2, 1)
    # The run lasts from the first request sent (0.0) to the last chunk received (3.5).
    assert summary["duration_s"] == 3.5
    assert summary["output_throughput"] == pytest.approx(5 / 3.5)
    assert summary["request_throughput"] == pytest.approx(2 / 3.5)
    assert summary["prompt_tokens"] == 30 and summary["length_mismatches"] == 1
    # TTFT: 1.0 - 0.0 and 2.5 - 0.5 s.
    assert summary["ttft_ms"]["p50"] == pytest.approx(1500) and summary["ttft_ms"]["mean"] == pytest.approx(1500)
    # ITL, pooled gaps: 500, 500 (first stream) and 1000 ms (second): p95 at rank 1.9 = 500 + 0.9 * 500.
    assert summary["itl_ms"]["p50"] == pytest.approx(500) and summary["itl_ms"]["p95"] == pytest.approx(950)
    # TPOT: (2.0 - 1.0) / 2 and (3.5 - 2.5) / 1 s.
    assert summary["tpot_ms"]["p50"] == pytest.approx(750) and summary["tpot_ms"]["p95"] == pytest.approx(975)
    assert workload.summarize(records[2:]) == {"requests": 1, "completed": 0, "failed": 1}


def test_the_published_mixed_serving_results_name_their_script_and_their_json_holds_the_table():
    markdown = ROOT / "docs" / "results" / "benchmark_serve_mixed_cpu.md"
    text = markdown.read_text()
    module = re.search(r"`python -m (benchmarks\.\w+)", text).group(1)
    assert importlib.util.find_spec(module) is not None
    # The measurements the table is computed from.
    results = json.loads(markdown.with_suffix(".json").read_text())["raw"]
    assert results["meta"]["command"].startswith(f"python -m {module}")
    rows = re.findall(r"^\| (\S+) \| (\S+) \| ([\d.]+)(?: \([\d.]+-[\d.]+\))? \|", text, flags=re.MULTILINE)
    assert rows
    for rate, engine, throughput in rows:
        runs = [run["summary"] for run in results["runs"] if run["engine"] == engine and run["rate"] == rate]
        assert runs, (rate, engine)
        median = numpy.median([run["output_throughput"] for run in runs])
        assert f"{median:.1f}" == throughput


# ------------------------------------------------------------------------------------------------ structured mix


def test_the_structured_share_gives_that_many_requests_a_schema_reproducibly_from_the_seed():
    items = workload.make_workload(CORPUS, 40, 32, 16, 0.5, rate=4, seed=5)
    schema = workload.structured_schema(24)

    def mix(share, seed=5):
        return workload.with_structured_share(items, share, seed, schema)

    half = mix(0.5)
    assert sum(item.schema is not None for item in half) == 20
    assert mix(0.5) == half  # the same seed picks the same requests
    picked = [index for index, item in enumerate(half) if item.schema is not None]
    assert picked != [index for index, item in enumerate(mix(0.5, seed=6)) if item.schema is not None]
    assert all(item.schema == schema for item in half if item.schema is not None)
    # Only the schema differs: prompts, lengths and arrival times are the plain workload's.
    assert [(i.prompt_ids, i.output_len, i.offset) for i in half] == [
        (i.prompt_ids, i.output_len, i.offset) for i in items
    ]
    assert sum(item.schema is not None for item in mix(0.3)) == 12
    assert all(item.schema is None for item in mix(0.0)) and all(item.schema is not None for item in mix(1.0))
    with pytest.raises(ValueError, match="fraction"):
        mix(1.5)


def test_a_structured_answer_cannot_end_before_the_longest_drawn_length():
    """Every keyword takes at least one token, so the schema's shortest answer (empty summary, one-letter keywords)
    is longer than `keywords` tokens: each constrained answer is cut by its max_tokens, as a plain one is."""
    jsonschema = pytest.importorskip("jsonschema")
    from serving_cases import tiny_chat_tokenizer

    keywords = workload.length_bounds(64, 0.5)[1]
    schema = workload.structured_schema(keywords)
    shortest = json.dumps({"summary": "", "keywords": ["a"] * keywords}, separators=(",", ":"))
    jsonschema.validate(json.loads(shortest), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"summary": "", "keywords": ["a"] * (keywords - 1)}, schema)
    assert len(tiny_chat_tokenizer()(shortest, add_special_tokens=False)["input_ids"]) > keywords


def test_request_bodies_carry_the_schema_as_vllms_structured_outputs():
    item = workload.WorkItem((1, 2), 12, 0.0)
    plain = workload.request_body("m", "Once", item, {"ignore_eos": True, "min_tokens": None})
    assert plain == {
        "model": "m", "prompt": "Once", "max_tokens": 12, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "min_tokens": 12,
    }  # fmt: skip
    schema = workload.structured_schema(12)
    constrained = workload.request_body("m", "Once", workload.WorkItem((1, 2), 12, 0.0, schema), {"ignore_eos": True})
    expected = {key: value for key, value in plain.items() if key != "min_tokens"}
    assert constrained == {**expected, "structured_outputs": {"json": schema}}


def test_the_mixed_workload_runs_on_vaswani_serve_with_every_constrained_answer_at_its_length(tiny_chat_pair):
    """The bodies `one_request` posts are what `vaswani serve` accepts: on a tiny model, a workload with half its
    requests under the mix's schema completes without an error, every answer has its drawn length (the constrained
    ones cut by max_tokens: "length"), and the server's /health counts the seconds it waited for masks."""
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    import asyncio

    import httpx
    from serving_cases import serving

    from vaswani.serving import create_app, load_service

    items = workload.make_workload(CORPUS, 6, 4, 10, 0.5, rate=math.inf, seed=1)
    items = workload.with_structured_share(items, 0.5, 1, workload.structured_schema(15))
    texts = ["Once upon a time", "The cat", "A small dog ran", "She said", "Tom and Lily", "It was a sunny day"]
    service = load_service(tiny_chat_pair["onnx"], threads=1, max_batch=4, max_waiting=16)
    with serving(create_app(service)) as server:
        before = workload.server_seconds(server.url)
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        records = asyncio.run(workload.run_workload(server.url, model, items, texts, [4] * 6, {"ignore_eos": True}))
        waited = workload.seconds_between(before, workload.server_seconds(server.url))
    assert [record.error for record in records] == [None] * 6
    assert [record.output_tokens for record in records] == [item.output_len for item in items]
    assert [record.structured for record in records] == [item.schema is not None for item in items]
    kinds = workload.kind_summaries(records)
    assert kinds["structured"]["completed"] == 3 and kinds["plain"]["completed"] == 3
    assert kinds["structured"]["finish_reasons"] == {"length": 3}
    # The schema held: each constrained answer opens the object (a random-weight model does not by itself).
    assert all(re.match(r"\s*\{", record.text) for record in records if record.structured), [r.text for r in records]
    assert {"grammar", "sampling", "decode"} <= set(waited) and waited["grammar"] >= 0
    entry = workload.run_entry(records, round=0, rate="inf")
    assert entry["summary"]["length_mismatches"] == 0
    assert sum(request.get("structured", False) for request in entry["requests"]) == 3
