"""Why vaswani's constrained decoding uses llguidance: xgrammar and llguidance measured on one tokenizer, for the same
JSON schemas and regular expression and the same answers, each library in a process of its own on one thread.

    python -m benchmarks.benchmark_grammar_libraries --tokenizer /tmp/smollm2-135m --rounds 5 \\
        --json docs/results/structured_outputs_cpu.json --markdown docs/results/structured_outputs_cpu.md

Measured per library (a library that does not import is reported as not measured):
- vocabulary setup: once per tokenizer (llguidance: `vaswani.constraints.grammar_vocabulary`; xgrammar:
  `TokenizerInfo.from_huggingface` and a `GrammarCompiler` with its cache);
- compile, first and repeated: a grammar and a matcher for one answer, with the library's cache emptied (first) and
  with the grammar in it (repeat: llguidance through `vaswani.constraints.compile_grammar`, whose cache is the path a
  server's repeated schema takes);
- per token: the mask filled, applied to a (1, vocab) float32 logits tensor, and the matcher advanced by the
  answer's next token, timed together (and apart), for every token of the answer and its end-of-sequence token.

llguidance runs through vaswani.constraints (`GrammarMatcher.mask`, `mask_scores`, `accept`), so what is measured is
what the server runs; xgrammar by its own API (`fill_next_token_bitmask`, `apply_token_bitmask_inplace`,
`accept_token`), and once more with its masks applied as vaswani applies llguidance's (`--measure xgrammar-masks`),
which separates the cost of the masks from that of the apply kernel. JSON is compact for both (no whitespace between tokens). One untimed warm-up round first (the
first mask starts llguidance's thread pool), then `--rounds` timed rounds. The page (benchmarks/results/structured.py)
gives each figure's median over rounds with its range.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.provenance import command_line, machine

LIBRARIES = ("llguidance", "xgrammar")
# What is measured, by the name the page shows: each library as it runs by itself, and xgrammar's masks applied as
# vaswani applies llguidance's (`mask_scores`'s unpacking and masked_fill), which tells the masks' cost from the
# apply kernel's.
MEASURED = {
    "llguidance": "llguidance",
    "xgrammar": "xgrammar",
    "xgrammar-masks": "xgrammar masks, vaswani's apply",
}

# (schema, an answer that satisfies it): a flat object, a nested one with arrays and enums, bounded numbers.
SCHEMAS = {
    "flat object": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
            },
            "required": ["name", "age", "email", "active"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "active": True},
    ),
    "nested object, arrays, enums": (
        {
            "type": "object",
            "properties": {
                "order": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "status": {"enum": ["pending", "shipped", "delivered"]},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    },
                    "required": ["id", "status", "tags"],
                    "additionalProperties": False,
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "size": {"enum": ["S", "M", "L", "XL"]},
                        },
                        "required": ["sku", "quantity", "size"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["order", "items"],
            "additionalProperties": False,
        },
        {
            "order": {"id": 4711, "status": "shipped", "tags": ["gift", "express"]},
            "items": [
                {"sku": "TS-RED-01", "quantity": 2, "size": "M"},
                {"sku": "HD-BLU-07", "quantity": 1, "size": "XL"},
            ],
        },
    ),
    "bounded numbers": (
        {
            "type": "object",
            "properties": {
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
                "altitude": {"type": "integer", "minimum": 0, "maximum": 9000},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["latitude", "longitude", "altitude", "confidence"],
            "additionalProperties": False,
        },
        {"latitude": 48.8584, "longitude": 2.2945, "altitude": 330, "confidence": 0.97},
    ),
}
# A regular expression (an e-mail address and a UTC time stamp) and an answer it matches.
REGEX = (
    r"[a-z]{1,16}(\.[a-z]{1,16})?@[a-z]{2,16}\.(com|org|net), [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
    "ada.lovelace@example.com, 2026-12-05T18:55:00Z",
)


def constraints() -> dict[str, tuple[str, object, str]]:
    """name -> (kind, source, answer text): the schemas (answers as compact JSON) and the regular expression."""
    found = {
        name: ("json_schema", schema, json.dumps(example, separators=(",", ":")))
        for name, (schema, example) in SCHEMAS.items()
    }
    found["regex (e-mail, time stamp)"] = ("regex", REGEX[0], REGEX[1])
    return found


# ------------------------------------------------------------------------------------------------ the two libraries


class LlguidanceCase:
    """llguidance through vaswani.constraints, as the server uses it."""

    def __init__(self, tokenizer):
        from vaswani.constraints import matching

        self.matching, self.tokenizer = matching, tokenizer

    def setup(self) -> None:
        self.matching.VOCABULARIES.clear()  # a vocabulary (and its grammar cache) is built once per tokenizer
        self.vocabulary = self.matching.grammar_vocabulary(self.tokenizer)

    def clear_cache(self) -> None:
        self.vocabulary.compiled.clear()

    def matcher(self, kind: str, source):
        from vaswani.constraints import Grammar, compile_grammar

        grammar = (
            Grammar.json_schema(source, flexible_whitespace=False) if kind == "json_schema" else Grammar.regex(source)
        )
        return compile_grammar(grammar, self.vocabulary).matcher()

    def steps(self, matcher):
        return matcher.mask, matcher.mask_scores, matcher.accept

    def finished(self, matcher) -> bool:
        return matcher.finished


class XgrammarCase:
    """xgrammar's own API, as vLLM drives it on CPU: a bitmask filled, applied in place, the matcher advanced."""

    def __init__(self, tokenizer, vaswani_apply: bool = False):
        import xgrammar

        self.xgrammar, self.tokenizer, self.vaswani_apply = xgrammar, tokenizer, vaswani_apply

    def setup(self) -> None:
        xgr, size = self.xgrammar, len(self.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=size, stop_token_ids=[self.end_id])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.bitmask = xgr.allocate_token_bitmask(1, size)

    @property
    def end_id(self) -> int:
        return self.tokenizer.eos_token_id

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, kind: str, source):
        if kind == "json_schema":
            compiled = self.compiler.compile_json_schema(source, any_whitespace=False, separators=(",", ":"))
        else:
            compiled = self.compiler.compile_regex(source)
        return self.xgrammar.GrammarMatcher(compiled)

    def steps(self, matcher):
        bitmask, apply = self.bitmask, self.xgrammar.apply_token_bitmask_inplace

        def accept(token: int) -> None:
            if not matcher.accept_token(token):
                raise ValueError(f"xgrammar refused token {token}")

        if self.vaswani_apply:
            from vaswani.constraints.matching import allowed_tokens

            def apply(scores, bitmask):
                return scores.masked_fill(~allowed_tokens(bitmask[0].numpy(), scores.shape[-1]), -float("inf"))

        return (lambda: matcher.fill_next_token_bitmask(bitmask)), (lambda scores: apply(scores, bitmask)), accept

    def finished(self, matcher) -> bool:
        return matcher.is_terminated()


def milliseconds(since: float) -> float:
    return 1e3 * (time.perf_counter() - since)


def measure(library: str, tokenizer_path: str, rounds: int) -> dict:
    """One library's figures (run in a process of its own: `--worker LIBRARY`)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    try:
        case = LlguidanceCase(tokenizer) if library == "llguidance" else XgrammarCase(tokenizer, library != "xgrammar")
    except ImportError as error:
        return {"skipped": f"{library} does not import here ({error})."}
    from importlib import metadata

    cases = constraints()
    answers = {
        name: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for name, (_, _, text) in cases.items()
    }
    logits = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(0))
    result = {
        "version": metadata.version(library.partition("-")[0]),
        "vocabulary_ms": [],
        "constraints": {
            name: {
                "tokens": len(answers[name]),
                "first_compile_ms": [],
                "repeat_compile_ms": [],
                "per_token_ms": [],
                "parts_ms": {"fill": [], "apply": [], "advance": []},
            }
            for name in cases
        },  # fmt: skip
    }
    for round_index in range(rounds + 1):  # round 0: the untimed warm-up
        start = time.perf_counter()
        case.setup()
        setup_ms = milliseconds(start)
        for name, (kind, source, _) in cases.items():
            case.clear_cache()
            start = time.perf_counter()
            case.matcher(kind, source)
            first_ms = milliseconds(start)
            start = time.perf_counter()
            matcher = case.matcher(kind, source)
            repeat_ms = milliseconds(start)
            fill, apply, advance = case.steps(matcher)
            totals, parts = [], {"fill": [], "apply": [], "advance": []}
            for token in answers[name]:  # one step timed whole, as a sampler runs it
                scores = logits.clone()
                start = time.perf_counter()
                fill()
                apply(scores)
                advance(token)
                totals.append(milliseconds(start))
            matcher = case.matcher(kind, source)
            fill, apply, advance = case.steps(matcher)
            for token in answers[name]:  # the same steps timed apart (the timers' own cost left in each part)
                scores = logits.clone()
                start = time.perf_counter()
                fill()
                middle = time.perf_counter()
                apply(scores)
                end = time.perf_counter()
                advance(token)
                parts["fill"].append(1e3 * (middle - start))
                parts["apply"].append(1e3 * (end - middle))
                parts["advance"].append(milliseconds(end))
            if not case.finished(matcher):
                raise RuntimeError(f"{library}: the answer of {name!r} did not complete its grammar")
            if round_index == 0:
                continue
            entry = result["constraints"][name]
            entry["first_compile_ms"].append(round(first_ms, 4))
            entry["repeat_compile_ms"].append(round(repeat_ms, 4))
            entry["per_token_ms"].append([round(value, 4) for value in totals])
            for part, values in parts.items():
                entry["parts_ms"][part].append(round(statistics.median(values), 4))
        if round_index:
            result["vocabulary_ms"].append(round(setup_ms, 1))
    return result


def run_worker(library: str, args) -> dict:
    """`measure` in a child process (one library's threads, caches and allocations never meet the other's)."""
    command = [sys.executable, "-m", "benchmarks.benchmark_grammar_libraries", "--worker", library]
    command += ["--tokenizer", args.tokenizer, "--rounds", str(args.rounds)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode:
        raise RuntimeError(f"the {library} worker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="/tmp/smollm2-135m", help="a transformers tokenizer folder")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one untimed warm-up round)")
    parser.add_argument("--measure", nargs="+", default=list(MEASURED), choices=MEASURED, help="default: all")
    parser.add_argument("--json", help="the structured-outputs page's JSON (its `libraries` part is written)")
    parser.add_argument("--markdown", help="the page rendered from --json")
    parser.add_argument("--worker", choices=MEASURED, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.tokenizer, args.rounds)))
        return
    load_before = os.getloadavg()[0]
    results = {MEASURED[name]: run_worker(name, args) for name in args.measure}
    for library, result in results.items():
        if "skipped" in result:
            print(f"{library}: {result['skipped']}")
            continue
        for name, entry in result["constraints"].items():
            pooled = [value for values in entry["per_token_ms"] for value in values]
            print(
                f"{library:10} {name:30} first compile {statistics.median(entry['first_compile_ms']):7.3f} ms, "
                f"repeat {statistics.median(entry['repeat_compile_ms']):6.3f} ms, per token p50 "
                f"{statistics.median(pooled):.4f} ms, max {max(pooled):.3f} ms"
            )
    from transformers import AutoTokenizer

    part = {
        "command": command_line(),
        "machine": machine(threads=1, shared=load_before >= 0.5, packages=("torch", "transformers", *LIBRARIES)),
        "load_before": load_before,
        "settings": {"rounds": args.rounds, "vocab_size": len(AutoTokenizer.from_pretrained(args.tokenizer))},
        "constraints": {
            name: {"kind": kind, "source": source, "answer": text}
            for name, (kind, source, text) in constraints().items()
        },  # fmt: skip
        "results": results,
    }
    if args.json:
        from benchmarks.structured_outputs_page import publish_part

        publish_part("libraries", part, Path(args.json), Path(args.markdown) if args.markdown else None)


if __name__ == "__main__":
    main()
