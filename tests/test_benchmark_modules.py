"""The benchmarks as a package (`python -m benchmarks.NAME` from the repository's root): every module imports, every
name a benchmark file takes from vaswani exists where it looks for it (imports inside functions and the workers run in
other engines' environments included), and the package keeps its shape: no `sys.path` edits, no file beside a folder
of the same name, table makers that import none of the scripts whose figures they compute. Nothing is timed here."""

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MODULES = sorted(module.name for module in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."))
# Every Python file under benchmarks/, the workers of other engines' environments (engines/, vllm/, serve_engines/)
# and one study's step scripts (gqa_decode_step/) included: they run as files, so only their imports are checked.
FILES = sorted(BENCHMARKS.rglob("*.py"))


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def test_the_package_lists_the_scripts_and_the_shared_modules():
    """The walk below is not empty: it finds the scripts, the shared provenance and the results pages' modules."""
    assert {"benchmarks.benchmark", "benchmarks.benchmark_engines", "benchmarks.provenance"} <= set(MODULES)
    assert {"benchmarks.results.pages", "benchmarks.results.cells", "benchmarks.results.quality"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports(name: str):
    """A moved or renamed vaswani name fails here, not in a user's run; an import through a deprecated path (the old
    `vaswani.conversion.onnx` shims warn with a FutureWarning) fails as well."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        importlib.import_module(name)


def vaswani_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for each `from vaswani... import name` and `import vaswani...` anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vaswani":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vaswani"]
    return sorted(found)


def missing_vaswani_names(path: Path) -> list[str]:
    missing = []
    for line, module_name, name in vaswani_imports(path):
        where = f"{relative(path)}:{line}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", FutureWarning)
                module = importlib.import_module(module_name)
                if name is not None and not hasattr(module, name):
                    try:
                        importlib.import_module(f"{module_name}.{name}")  # a submodule, not an attribute
                    except ModuleNotFoundError:
                        raise ImportError(f"{module_name} has no {name}") from None
        except (ImportError, FutureWarning) as error:
            missing.append(f"{where}: {module_name}{'.' + name if name else ''} ({error})")
    return missing


@pytest.mark.parametrize("path", FILES, ids=[relative(path) for path in FILES])
def test_every_name_a_benchmark_takes_from_vaswani_exists(path: Path):
    """Imports inside functions (a worker's, a child process's) run only when that path does: read them from the
    source instead, so a moved API breaks CI rather than an hours-long run at its last step."""
    missing = missing_vaswani_names(path)
    assert not missing, "\n".join(missing)


def test_the_name_check_finds_a_missing_name(tmp_path: Path):
    """The check above can fail: a name vaswani does not have, a module it does not have, and a shim's old path."""
    script = tmp_path / "script.py"
    script.write_text(
        "from vaswani.runtime import OrtModelForCausalLM\n"
        "def run():\n    from vaswani.runtime import NoSuchModel\n"
        "import vaswani.no_such_room\n"
        "from vaswani.conversion.onnx import export_onnx\n"
    )
    missing = missing_vaswani_names(script)
    assert [entry.split(":")[1] for entry in missing] == ["3", "4", "5"], missing


def unknown_keywords(path: Path) -> list[str]:
    """Keyword arguments a benchmark file passes to a function it imports from vaswani (`export_onnx(...,
    quantize=...)`) that the function's signature does not take (a function taking **kwargs accepts any; classes are
    left out, transformers' configs taking keywords their signature does not show)."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        alias.asname or alias.name: (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vaswani"
        for alias in node.names
    }
    unknown = []
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        if call.func.id not in imported:
            continue
        module_name, name = imported[call.func.id]
        function = getattr(importlib.import_module(module_name), name, None)
        if not inspect.isfunction(function):
            continue  # a missing name fails the test above; a class (a transformers config) may take more than it says
        parameters = inspect.signature(function).parameters
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
            continue
        for keyword in call.keywords:
            if keyword.arg is not None and keyword.arg not in parameters:
                unknown.append(f"{relative(path)}:{call.lineno}: {name}(..., {keyword.arg}=...)")
    return sorted(unknown)


@pytest.mark.parametrize("path", FILES, ids=[relative(path) for path in FILES])
def test_every_keyword_a_benchmark_passes_to_vaswani_is_taken(path: Path):
    """A renamed or folded keyword (`export_onnx`'s quantization options) fails here rather than in a run."""
    unknown = unknown_keywords(path)
    assert not unknown, "\n".join(unknown)


def test_the_keyword_check_finds_a_keyword_the_function_does_not_take(tmp_path: Path):
    script = tmp_path / "script.py"
    script.write_text(
        "from vaswani.export import export_onnx\n"
        "export_onnx('model', 'out', overwrite=True)\n"
        "export_onnx('model', 'out', no_such_option=1)\n"
    )
    assert [entry.split(": ")[1] for entry in unknown_keywords(script)] == ["export_onnx(..., no_such_option=...)"]


def sys_path_edits(path: Path) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
    ]


def test_no_benchmark_edits_sys_path():
    """The scripts import each other and the shared modules as `benchmarks.NAME`; the workers run as files in other
    environments and import only their own folder, which Python puts first on the path by itself."""
    edits = {relative(path): lines for path in FILES if (lines := sys_path_edits(path))}
    assert not edits, f"sys.path edited in {edits}"


def test_no_file_shares_its_name_with_a_folder_beside_it():
    """`benchmarks/x.py` beside `benchmarks/x/` makes `import benchmarks.x` ambiguous to a reader (Python takes the
    folder when it is a package, the file otherwise)."""
    clashes = [
        relative(folder) for folder in BENCHMARKS.rglob("*") if folder.is_dir() and folder.with_suffix(".py").exists()
    ]
    assert not clashes


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
    return modules


SHARED = [BENCHMARKS / "provenance.py", *sorted((BENCHMARKS / "results").glob("*.py"))]


@pytest.mark.parametrize("path", SHARED, ids=[relative(path) for path in SHARED])
def test_the_shared_modules_import_the_standard_library_and_each_other_only(path: Path):
    """The results pages render from their JSON alone: a table maker never imports the script that measured (the
    old int4_domains <-> results circle), and the shared modules need nothing but the standard library, since the
    scripts that import them also start as workers in other engines' environments (onnxruntime-genai's, for one)."""
    shared = {"benchmarks.provenance", "benchmarks.results", *(f"benchmarks.results.{p.stem}" for p in SHARED)}
    foreign = {
        module
        for module in imported_modules(path)
        if module not in shared and module.split(".")[0] not in sys.stdlib_module_names
    }
    assert not foreign, f"{relative(path)} imports {foreign}"


def test_a_benchmark_runs_as_a_module_from_the_repository_root():
    """What the docs show, run as a user types it (no PYTHONPATH, the tests' path settings not inherited): the
    results renderer prints a page's rendered part from its JSON, and `make benchmark`'s module parses --help."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    page = subprocess.run(
        [sys.executable, "-m", "benchmarks.results", "docs/results/benchmark_cpu.json"],
        cwd=ROOT, env=environment, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert (ROOT / "docs" / "results" / "benchmark_cpu.md").read_text().startswith(page)
    assert "Made by `python -m benchmarks.benchmark " in page
    usage = subprocess.run(
        [sys.executable, "-m", "benchmarks.benchmark", "--help"],
        cwd=ROOT, env=environment, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert usage.startswith("usage: ") and "--family" in usage


def test_a_run_records_its_command_as_the_reader_types_it(monkeypatch):
    """`provenance.command_line`, the Made-by line of every page: a benchmark run as a module is recorded as
    `python -m benchmarks.NAME`, a script run as a file (an example) by its path from the repository's root; the
    arguments are quoted as a shell needs them."""
    from types import ModuleType, SimpleNamespace

    from benchmarks.provenance import command_line

    main = ModuleType("__main__")
    main.__spec__ = SimpleNamespace(name="benchmarks.benchmark")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "benchmark.py"), "--threads", "1", "--note", "a b"])
    assert command_line() == "python -m benchmarks.benchmark --threads 1 --note 'a b'"
    main.__spec__ = None
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / "train_string_reversal.py"), "--json", "x.json"])
    assert command_line() == "python examples/train_string_reversal.py --json x.json"


def test_the_grammar_library_benchmarks_answers_satisfy_their_constraints():
    """The answers whose tokens the two libraries are timed on are valid: each schema's compact JSON validates (the
    jsonschema package as the oracle) and the regular expression matches its answer whole."""
    import json
    import re

    jsonschema = pytest.importorskip("jsonschema")
    from benchmarks.benchmark_grammar_libraries import constraints

    found = constraints()
    assert [kind for kind, _, _ in found.values()].count("json_schema") == 3 and len(found) == 4
    for name, (kind, source, answer) in found.items():
        if kind == "json_schema":
            jsonschema.validate(json.loads(answer), source)
            assert ", " not in answer and ": " not in answer, name  # compact, as both libraries are told
        else:
            assert re.fullmatch(source, answer), name


def library_part(rounds: list[list[float]], version: str) -> dict:
    """A `libraries` result of one library and one constraint, per-token times per round as given."""
    return {
        "version": version,
        "vocabulary_ms": [300.0] * len(rounds),
        "constraints": {
            "flat object": {
                "tokens": len(rounds[0]),
                "first_compile_ms": [2.0] * len(rounds),
                "repeat_compile_ms": [0.1] * len(rounds),
                "per_token_ms": rounds,
                "parts_ms": {part: [0.01] * len(rounds) for part in ("fill", "apply", "advance")},
            }
        },
    }


def served_run(round_index: int, mix: str, throughput: float) -> dict:
    summary = {"output_throughput": throughput, "output_tokens": 100, "failed": 0, "length_mismatches": 0}
    summary.update(itl_ms={"p50": 40.0, "p95": 90.0}, ttft_ms={"p50": 500.0, "p95": 900.0})
    kinds = {"structured": {"itl_ms": {"p50": 41.0}, "finish_reasons": {"length": 2}}} if mix == "structured" else {}
    return {"round": round_index, "engine": "vaswani-int8", "rate": "inf", "mix": mix, "summary": summary,
            "server_seconds": {"grammar": 0.02, "sampling": 0.1}, "kinds": kinds}  # fmt: skip


def test_the_structured_outputs_page_renders_each_scripts_part_and_keeps_the_other(tmp_path: Path):
    """Two scripts write the page: each `publish_part` replaces its own part and keeps the other's; the tables are
    medians over rounds with their ranges, ratios round by round, and overlapping ranges are called a tie."""
    import json

    from benchmarks.provenance import machine
    from benchmarks.results.pages import TABLE_MAKERS
    from benchmarks.structured_outputs_page import publish_part

    json_path, page_path = tmp_path / "structured.json", tmp_path / "structured.md"
    libraries = {
        "command": "python -m benchmarks.benchmark_grammar_libraries --rounds 2",
        "machine": machine(threads=1),
        "load_before": 0.1,
        "settings": {"rounds": 2, "vocab_size": 49152},
        "results": {
            "llguidance": library_part([[0.1, 0.1, 0.3], [0.1, 0.2, 0.2]], "1.9.1"),
            "xgrammar": library_part([[0.4, 0.4, 0.5], [0.3, 0.5, 0.5]], "0.2.9"),
        },
    }
    publish_part("libraries", libraries, json_path, page_path)
    arguments = {"rates": "[inf]", "engines": ["vaswani-int8"], "structured_share": 0.5, "threads": 2, "rounds": 2}
    arguments.update(max_batch=16, num_prompts=24, seed=0, input_len=128, output_len=64, range_ratio=0.5)
    serving = {
        "command": "python -m benchmarks.benchmark_serve_mixed --structured-share 0.5",
        "machine": machine(threads=2),
        "load_before": 0.2,
        "meta": {"args": arguments, "machine": {"cpu": "a CPU", "cores": 2}, "load": [0.2, 1.9]},
        "runs": [served_run(0, "plain", 100.0), served_run(0, "structured", 96.0), served_run(1, "plain", 104.0)]
        + [served_run(1, "structured", 90.0)],
    }
    publish_part("serving", serving, json_path, page_path)
    results = json.loads(json_path.read_text())
    assert set(results["raw"]) == {"libraries", "serving"}
    assert results["command"] == f"{libraries['command']}; {serving['command']}"
    setup, costs, versus, served = TABLE_MAKERS[results["tables_from"]](results["raw"], results["machine"])
    assert [row[:3] for row in setup["rows"]] == [
        ["llguidance", "1.9.1", "300 (300-300)"],
        ["xgrammar", "0.2.9", "300 (300-300)"],
    ]
    # Per-round medians 0.1 and 0.2 (llguidance), 0.4 and 0.5 (xgrammar): ratios 4.0 and 2.5, no overlap.
    assert costs["rows"][0][5] == "0.150 (0.100-0.200)" and costs["rows"][1][5] == "0.450 (0.400-0.500)"
    assert versus["rows"][0][1:4] == ["xgrammar", "3.25x (2.50-4.00)", "llguidance 3.0x faster"]
    assert versus["rows"][0][5] == "tie (ranges overlap)"  # the same compile times
    plain, mixed = served["rows"]
    assert plain[2:4] == ["plain", "102.0 (100.0-104.0)"] and mixed[2:4] == ["50% JSON schema", "93.0 (90.0-96.0)"]
    assert mixed[4] == "0.91x (0.87-0.96)" and mixed[5] == "9% slower, within the 10% target"  # apart
    assert mixed[14] == "4 length"
    publish_part("libraries", libraries, json_path, page_path)  # a new library run keeps the served part
    assert set(json.loads(json_path.read_text())["raw"]) == {"libraries", "serving"}
    assert "Served: the same requests" in page_path.read_text()


def test_an_engine_workers_memory_is_this_processs_and_the_page_shows_its_median_and_range():
    """`benchmarks/engines/worker.py`'s memory record is the kernel's count for the process (resident now is at most
    its peak; a large array it allocates shows in the anonymous part), and the engines page shows each system's
    median and range over rounds beside its weight files."""
    from benchmarks.engines.worker import memory
    from benchmarks.results.engines import memory_table

    before = memory()
    held = bytearray(64 << 20)
    held[:: 4096] = b"x" * len(held[:: 4096])  # touch every page
    after = memory()
    assert after["anon_bytes"] + after["file_bytes"] <= after["peak_rss_bytes"]
    assert after["anon_bytes"] - before["anon_bytes"] >= 60 << 20
    runs = [{"memory": {"peak_rss_bytes": 3e9, "anon_bytes": 2e9, "file_bytes": 1e9}},
            {"memory": {"peak_rss_bytes": 4e9, "anon_bytes": 2.5e9, "file_bytes": 1e9}}, None]  # fmt: skip
    made = memory_table({"a": runs, "b": [{"decode": {}}]}, {"a": {"bytes": 1.5e9}})
    assert made["rows"] == [["a", "3500 (3000-4000)", "2250 (2000-2500)", "1000 (1000-1000)", "1500"]]
