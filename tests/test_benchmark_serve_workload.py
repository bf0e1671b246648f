"""The mixed serving benchmark's workloads and statistics (benchmarks/serve_workload.py,
benchmarks/serve_conversations.py) on fixed inputs, with expectations derived from the definitions vLLM's serving
benchmark uses: the independent prompts; the shared system prompt, 500-1000 tokens that every such prompt really
starts with; multi-turn chats whose turns resend the previous prompt and its answer; the same requests for a seed.
Then its engine variants (benchmarks/serve_variants.py: a variant's flags reach its server's command and its results
row), its table per workload (benchmarks/results/serve_workloads.py) and its published results table: the command it
names exists and its JSON parses and holds what the table shows."""

import asyncio
import importlib.util
import json
import math
import random
import re
from pathlib import Path

import numpy
import pytest

from benchmarks import serve_conversations as conversations
from benchmarks import serve_workload as workload
from benchmarks.results.serve_workloads import serve_workload_tables
from benchmarks.serve_variants import compute_precision, engine_spec, parse_variants

ROOT = Path(__file__).resolve().parent.parent

CORPUS = list(range(10_000))  # token i at position i: a prompt is a window iff its ids are consecutive
SMOLLM2_FOLDERS = [Path("/tmp/smollm2-135m"), Path("/tmp/smol/hf")]  # the benchmark's tokenizer, where one is here


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
    published = json.loads(markdown.with_suffix(".json").read_text())
    results = published["raw"]
    assert results["meta"]["command"].startswith(f"python -m {module}")
    if published["tables_from"] == "serve_workloads":  # a table per workload: each row as the maker computes it
        for made in serve_workload_tables(results, published["machine"]):
            assert made["rows"] and all("| " + " | ".join(row) + " |" in text for row in made["rows"])
        return
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


# ------------------------------------------------------------------------------------------------ shared prefix, chats


def tokenizers():
    """The benchmark's tokenizer (SmolLM2's, where a local copy exists) and the package's tiny corpus BPE, whose
    tokens are shorter: the system prompt must hold with either."""
    from serving_cases import tiny_chat_tokenizer

    found = {"tiny-corpus-bpe": tiny_chat_tokenizer()}
    for folder in SMOLLM2_FOLDERS:
        if (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            found["smollm2"] = AutoTokenizer.from_pretrained(folder)
            break
    return found


@pytest.fixture(scope="module", params=["smollm2", "tiny-corpus-bpe"])
def tokenizer(request):
    found = tokenizers()
    if request.param not in found:
        pytest.skip(f"no local SmolLM2 tokenizer in {', '.join(map(str, SMOLLM2_FOLDERS))}")
    return found[request.param]


def test_every_shared_prefix_prompt_starts_with_the_same_500_to_1000_tokens(tokenizer):
    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix = conversations.system_prefix_ids(encode, conversations.system_text(), most=800)
    assert 500 <= len(prefix) <= 800
    assert tokenizer.decode(prefix).endswith(".")  # whole paragraphs, no trailing blank line: see system_prefix_ids
    corpus_ids = encode(" ".join(conversations.dialogue_utterances()) * 4)
    separator = tuple(encode("\n\n"))
    items = conversations.make_shared_prefix_workload(prefix, corpus_ids, 40, 64, 16, 0.5, 4, 0, 1.0, separator)
    suffixes = set()
    for item in items:
        # What the server sees: the text the client sends, tokenized again.
        sent = encode(tokenizer.decode(item.prompt_ids))
        assert tuple(sent[: len(prefix)]) == prefix
        suffixes.add(item.prompt_ids[len(prefix) :])
    assert len(suffixes) == 40  # a distinct prompt after the shared part


def test_the_shared_prefix_workload_is_the_independent_one_behind_the_prefix():
    prefix = tuple(range(20_000, 20_600))
    shared = conversations.make_shared_prefix_workload(prefix, CORPUS, 30, 40, 20, 0.5, rate=2, seed=3)
    plain = workload.make_workload(CORPUS, 30, 40, 20, 0.5, rate=2, seed=3)
    assert [item.prompt_ids for item in shared] == [prefix + item.prompt_ids for item in plain]
    separated = conversations.make_shared_prefix_workload(prefix, CORPUS, 30, 40, 20, 0.5, 2, 3, separator_ids=(7,))
    assert separated[0].prompt_ids == prefix + (7,) + plain[0].prompt_ids
    assert [(item.output_len, item.offset) for item in shared] == [(item.output_len, item.offset) for item in plain]
    assert conversations.make_shared_prefix_workload(prefix, CORPUS, 30, 40, 20, 0.5, rate=2, seed=3) == shared


def test_a_system_text_too_short_for_500_tokens_is_refused():
    with pytest.raises(ValueError, match="needs 500"):
        conversations.system_prefix_ids(lambda text: text.split(), "a few words.\n\nand more.", most=1000)


def test_each_turn_resends_the_previous_prompt_and_its_answer_then_the_next_user_turn():
    utterances = conversations.dialogue_utterances()
    assert len(utterances) > 20 and all(": " in line and "\n" not in line for line in utterances)
    chats = conversations.make_conversations(utterances, 6, turns=4, output_len=32, range_ratio=0.5, rate=2, seed=1)
    for chat in chats:
        answers = [f" answer {turn} of {chat.offset:.3f}" for turn in range(3)]
        prompts = conversations.conversation_prompts(chat, answers)
        assert len(prompts) == 4 and prompts[0] == chat.user_turns[0]
        for turn in range(1, 4):
            assert prompts[turn].startswith(prompts[turn - 1] + answers[turn - 1])
            assert prompts[turn].endswith(chat.user_turns[turn])
        # A user turn is 1-3 consecutive lines of the dialogue, each ending the prompt on a new line.
        for user_turn in chat.user_turns:
            lines = user_turn.rstrip("\n").split("\n")
            assert user_turn.endswith("\n") and 1 <= len(lines) <= 3
            start = utterances.index(lines[0])
            assert lines == [utterances[(start + k) % len(utterances)] for k in range(len(lines))]
        assert all(16 <= length <= 48 for length in chat.output_lens)


def test_conversations_are_the_same_for_a_seed_and_arrive_as_the_independent_requests_do():
    utterances = conversations.dialogue_utterances()

    def draw(seed, rate=2.0):
        return conversations.make_conversations(utterances, 8, 3, 32, 0.5, rate, seed, think_time=0.5)

    assert draw(0) == draw(0) and draw(0) != draw(1)
    offsets = [chat.offset for chat in draw(0)]
    assert offsets == [item.offset for item in workload.make_workload(CORPUS, 8, 10, 10, 0.5, 2.0, 0)]
    assert [chat.offset for chat in draw(0, math.inf)] == [0.0] * 8
    assert {chat.think_time for chat in draw(0)} == {0.5}


def test_variants_add_their_flags_and_name_the_runtime():
    variants = parse_variants(["tokens64=--max-num-batched-tokens 64"])
    spec = engine_spec("vaswani-int8-openvino+noprefix+tokens64", variants)
    assert (spec.family, spec.weights, spec.runtime) == ("vaswani", "int8", "openvino")
    assert spec.flags == ("--prefix-cache-bytes", "0", "--max-num-batched-tokens", "64")
    assert engine_spec("vaswani-int4").runtime == "onnxruntime" and engine_spec("vaswani-int4").flags == ()
    assert engine_spec("openvino-int8+noprefix").flags == ("--no-prefix-caching",)
    assert engine_spec("llama-server-q8_0").weights == "q8_0"
    with pytest.raises(ValueError, match="no variant 'noprefix' for llama-server"):
        engine_spec("llama-server-q8_0+noprefix")
    with pytest.raises(ValueError, match="unknown engine"):
        engine_spec("vaswani-int3")
    with pytest.raises(ValueError, match="NAME=FLAGS"):
        parse_variants(["--max-num-batched-tokens 64"])


def test_a_variant_reaches_the_server_command(tmp_path):
    import argparse

    from benchmarks.benchmark_serve_mixed import server_command

    args = argparse.Namespace(
        venvs=str(tmp_path), threads=2, max_batch=4, num_prompts=4, vaswani_flags="", openvino_precision="auto",
        variants=parse_variants(["tokens64=--max-num-batched-tokens 64"]), ctx_per_slot=512,
    )  # fmt: skip
    command, _, fixed = server_command("vaswani-fp32-openvino+tokens64", tmp_path, 8123, args)
    assert command[-6:] == ["--engine", "openvino", "--openvino-precision", "auto", "--max-num-batched-tokens", "64"]
    assert fixed == {"ignore_eos": True}
    command, _, _ = server_command("openvino-int8+noprefix", tmp_path, 8123, args)
    assert command[-1] == "--no-prefix-caching"
    # The default export under --engine auto: the runtime auto picks is named in the row's precision label.
    command, _, _ = server_command("vaswani-int8-auto+noprefix", tmp_path, 8123, args)
    assert command[-6:] == ["--engine", "auto", "--openvino-precision", "auto", "--prefix-cache-bytes", "0"]
    from benchmarks.serve_variants import auto_runs_openvino

    auto = engine_spec("vaswani-int8-auto")
    if auto_runs_openvino(auto):  # this CPU: OpenVINO, as --engine openvino on a portable export
        assert compute_precision(auto, "f32") == compute_precision(engine_spec("vaswani-int8-openvino"), "f32").replace(
            "portable export", "the default export's portable graph, --engine auto"
        )
    else:
        assert compute_precision(auto, "f32") == compute_precision(engine_spec("vaswani-int8"), "f32")


def summary(throughput, ttft):
    return {"output_throughput": throughput, "request_throughput": 1.0, "failed": 0,
            "ttft_ms": {"p50": ttft, "p95": 2 * ttft}, "itl_ms": {"p50": 10.0, "p95": 20.0}, "tpot_ms": {"p50": 11.0}}  # fmt: skip


def test_the_table_per_workload_shows_medians_ranges_flags_and_the_prefix_cache_ratio():
    engines = ["vaswani-int8", "vaswani-int8+noprefix"]
    runs = []
    for round_index, (fast, slow) in enumerate([(100.0, 300.0), (120.0, 600.0), (110.0, 330.0)]):
        for name in ("shared-prefix", "multi-turn"):
            runs.append({"round": round_index, "engine": engines[0], "rate": "inf", "workload": name,
                         "summary": summary(50.0 + round_index, fast), "later_turns": {"ttft_ms": {"p50": fast / 2}}})  # fmt: skip
            runs.append({"round": round_index, "engine": engines[1], "rate": "inf", "workload": name,
                         "summary": summary(40.0, slow), "later_turns": {"ttft_ms": {"p50": slow}}})  # fmt: skip
    raw = {
        "meta": {
            "args": {"rates": "[inf]", "engines": engines, "workloads": ["shared-prefix", "multi-turn"]},
            "engines": {
                engines[0]: {"flags": "", "precision": "int8 weights"},
                engines[1]: {"flags": "--prefix-cache-bytes 0", "precision": "int8 weights"},
            },
        },
        "runs": runs,
    }
    shared, chats, ratios = serve_workload_tables(raw, {})
    assert shared["heading"].startswith("Workload: shared-prefix") and chats["heading"].startswith("Workload: multi")
    assert shared["rows"][0][:5] == ["inf", "vaswani-int8", "-", "int8 weights", "51.0 (50.0-52.0)"]
    assert shared["rows"][1][2] == "`--prefix-cache-bytes 0`"
    assert shared["columns"][6] == "TTFT p50 ms" and shared["rows"][0][6] == "110 (100-120)"
    assert chats["columns"][-2] == "TTFT p50 ms, turns 2+" and chats["rows"][0][-2] == "55 (50-60)"
    # Without over with the cache, round by round: 3.0, 5.0, 3.0.
    assert ratios["rows"][0] == ["shared-prefix", "inf", "vaswani-int8", "3.00x (3.00-5.00)"]


def test_a_servers_memory_is_its_own_processs_and_the_page_shows_it_after_each_rounds_last_run():
    """`Server.memory` reads the server's process (a child holding 64 MiB it touched shows them as anonymous memory,
    which this process does not), and the page shows each server's memory after the last run of each round, its
    median and range over rounds."""
    import subprocess
    import sys

    from benchmarks.engines.worker import memory

    holder = "import sys, time; held = bytearray(64 << 20); held[::4096] = b'x' * len(held[::4096]); print(1); " \
        "sys.stdout.flush(); time.sleep(60)"  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        held, own = memory(child.pid), memory()
    finally:
        child.kill()
        child.wait()
    assert held["anon_bytes"] >= 64 << 20 and held["anon_bytes"] + held["file_bytes"] <= held["peak_rss_bytes"]
    assert own["anon_bytes"] != held["anon_bytes"]

    def run(round_index, rate, anon):
        return {"round": round_index, "engine": "vaswani-int8", "rate": rate, "summary": summary(50.0, 100.0),
                "memory": {"peak_rss_bytes": 3e9 + anon, "anon_bytes": anon, "file_bytes": 1e9}}  # fmt: skip

    runs = [run(0, "2.0", 1e9), run(0, "inf", 2e9), run(1, "2.0", 1.5e9), run(1, "inf", 2.5e9)]
    raw = {"meta": {"args": {"rates": "[2.0, inf]", "engines": ["vaswani-int8"]}}, "runs": runs}
    _, memory_table = serve_workload_tables(raw, {})
    assert memory_table["heading"].startswith("Server memory")
    assert memory_table["rows"] == [["vaswani-int8", "5250 (5000-5500)", "2250 (2000-2500)", "1000 (1000-1000)"]]


def test_a_multi_turn_run_on_vaswani_serve_resends_each_answer(tiny_chat_pair):
    """Against a tiny model's server, every turn completes at its length and each later turn's prompt holds the
    earlier prompt and the answer the server gave (more prompt tokens than the turn before and its answer)."""
    pytest.importorskip("fastapi")
    import httpx
    from serving_cases import serving
    from transformers import AutoTokenizer

    from vaswani.serving import create_app, load_service

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_pair["onnx"])
    chats = conversations.make_conversations(
        ["Tom: Hello there.", "Maya: Hi Tom.", "Tom: How are you?"], 2, 3, 6, 0.5, math.inf, seed=2
    )

    def count_tokens(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    service = load_service(tiny_chat_pair["onnx"], threads=1, max_batch=4, max_waiting=16)
    with serving(create_app(service)) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        records = asyncio.run(
            conversations.run_conversations(server.url, model, chats, {"ignore_eos": True}, count_tokens)
        )
    assert [record.error for record in records] == [None] * 6
    assert [record.output_tokens for record in records] == [n for chat in chats for n in chat.output_lens]
    for chat_index in range(2):
        turns = records[3 * chat_index : 3 * chat_index + 3]
        for before, after in zip(turns, turns[1:]):
            assert after.sent >= before.chunks[-1]  # sent once the answer before it completed
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens - 2  # the answer, re-tokenized


def test_a_run_builds_every_workload_at_every_rate_with_a_warm_up_each():
    """benchmark_serve_mixed's requests: per workload a warm-up and each rate; the shared-prefix texts all open with
    the same system prompt; multi-turn has --num-prompts / --turns conversations per rate."""
    import argparse

    from serving_cases import tiny_chat_tokenizer

    from vaswani.data import corpus_stories

    args = argparse.Namespace(
        workloads=list(conversations.WORKLOADS), rates=[2.0, math.inf], num_prompts=8, input_len=32, output_len=8,
        range_ratio=0.5, seed=0, burstiness=1.0, prefix_tokens=1000, turns=2, conversations=0, think_time=0.0,
        structured_share=0.0,
    )  # fmt: skip
    tokenizer = tiny_chat_tokenizer()
    made, described = conversations.build_workloads(args, tokenizer, corpus_stories()[:200])
    expected = {f"{name} {rate}" for name in conversations.WORKLOADS for rate in ("warm-up", 2.0, math.inf)}
    assert set(made) == expected
    _, items, texts, counts = made["shared-prefix 2.0"]
    prefix = tokenizer.decode(items[0].prompt_ids[: described["shared-prefix"]["prefix_tokens"]])
    assert all(text.startswith(prefix) for text in texts) and len(texts) == 8
    assert 500 <= described["shared-prefix"]["prefix_tokens"] <= 1000
    kind, chats = made["multi-turn inf"]
    assert kind == "conversations" and len(chats) == 4 and all(len(chat.user_turns) == 2 for chat in chats)
    assert made["multi-turn warm-up"][0] == "requests"


def test_openvino_rows_name_their_kv_cache_and_int8_activations():
    """The labels say what each OpenVINO-backed server computes with: vaswani's paged cache in the precision its flags
    ask for (by default the compute precision's 16-bit type, `kv_cache_type("auto", ...)`: f16 at f32 compute, bf16
    at bf16), OpenVINO GenAI's as its shim reports the CPU plugin's defaults."""
    plain = compute_precision(engine_spec("vaswani-int8-openvino", {}), "f32")
    half = compute_precision(engine_spec("vaswani-int8-openvino+kvf16", {}), "f32")
    full = compute_precision(engine_spec("vaswani-int8-openvino+kvf32", {}), "f32")
    assert "f16 KV cache" in plain and "f16 KV cache" in half and "f32 KV cache" in full
    assert "int8 activations in groups of 32" in plain
    floats = compute_precision(engine_spec("vaswani-int8-openvino+floatact", {}), "f32")
    assert "int8 activations" not in floats and "f16 KV cache" in floats
    assert "int8 activations" not in compute_precision(engine_spec("vaswani-fp32-openvino", {}), "f32")
    assert "bf16 KV cache" in compute_precision(engine_spec("vaswani-int8-openvino", {}), "bf16")
    with pytest.raises(ValueError, match="--openvino-precision f32"):  # no float32 cache at bf16 compute
        compute_precision(engine_spec("vaswani-int8-openvino+kvf32", {}), "bf16")
    settings = {"kv_cache_precision": "u8", "dynamic_quantization_group_size": "32"}
    genai = compute_precision(engine_spec("openvino-int8", {}), "f32", "f32", settings)
    assert genai == "int8 weights (NNCF), f32 compute, int8 activations in groups of 32, u8 KV cache (OpenVINO GenAI)"
