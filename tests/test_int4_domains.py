"""The published int4 quality (benchmarks/int4_domains.py, docs/results/int4_domains.md): the texts that chose the
defaults are reported apart from held-out texts that no default was tuned on, no tuning code reads the held-out
texts, the page's tables are what its raw perplexities give, and the README and deployment guide quote both sets."""

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks import int4_domains
from benchmarks.results import quality

ROOT = Path(__file__).resolve().parents[1]

TUNING_DOMAINS = {"technical", "legal", "dialogue", "code", "stories"}
RESULTS = json.loads((ROOT / "docs" / "results" / "int4_domains.json").read_text())


def test_held_out_texts_ship_with_the_repository_in_other_domains_than_the_tuning_texts():
    held_out = int4_domains.held_out_texts()
    assert len(held_out) >= 4 and not set(held_out) & TUNING_DOMAINS
    readme = (int4_domains.HELD_OUT_FOLDER / "README.md").read_text()
    for name, text in held_out.items():
        assert len(text.split()) >= 500, f"{name}: several hundred words at least"
        assert f"`{name}.txt`" in readme, f"the held-out README does not say what {name}.txt is"


def test_no_code_but_the_quality_pages_reads_the_held_out_texts():
    """No exporter, calibration or benchmark code may tune on them: only the quality pages, which score builds and
    choose nothing, name their folder (int4_domains.py, and kv_cache_quality.py through its text sets)."""
    sources = [
        *(ROOT / "vaswani").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(ROOT / "examples").glob("*.py"),
    ]
    quality_pages = {"int4_domains.py", "kv_cache_quality.py"}
    readers = [path for path in sources if "held_out" in path.read_text() and path.name not in quality_pages]
    assert not readers, f"these read the held-out texts: {readers}"


def test_domain_tables_pool_a_sets_tokens_and_range_its_texts():
    """The summary's figures from made-up raw values, worked by hand: a reference at NLL 1 over 100 tokens and 2 over
    300, a build at 1.1 and 2.1, is +10.5% pooled (exp 0.1) and per text; a held-out text at 3.0 against 3.2 is
    -18.1% (exp -0.2)."""
    runs = {
        "fp32": {"a": (1.0, 100), "b": (2.0, 300), "c": (3.2, 50)},
        "int4": {"a": (1.1, 100), "b": (2.1, 300), "c": (3.0, 50)},
    }
    raw = {
        "texts": {"a": {"set": "tuning"}, "b": {"set": "tuning"}, "c": {"set": "held-out"}},
        "builds": {"fp32": {"weight_bytes": 4e6}, "int4": {"weight_bytes": 1e6}},
        "runs": {
            build: {
                text: {"perplexity": math.exp(nll), "mean_nll": nll, "tokens": tokens}
                for text, (nll, tokens) in texts.items()
            }
            for build, texts in runs.items()
        },
    }
    tuning, held_out, summary = quality.domain_tables(raw)
    assert [row[0] for row in tuning["rows"]] == ["a", "b"] and [row[0] for row in held_out["rows"]] == ["c"]
    assert tuning["rows"][1] == ["b", "300", "7.39", "8.17 (+10.5%)"]
    assert summary["rows"] == [["int4", "1.0", "+10.5%", "+10.5% to +10.5%", "-18.1%", "-18.1% to -18.1%"]]


def test_the_page_publishes_both_sets_labelled_as_its_raw_perplexities_give_them():
    raw = RESULTS["raw"]
    held_out = {name for name, about in raw["texts"].items() if about["set"] == int4_domains.HELD_OUT}
    tuning = {name for name, about in raw["texts"].items() if about["set"] == int4_domains.TUNING}
    assert tuning == TUNING_DOMAINS and held_out == set(int4_domains.held_out_texts())
    assert RESULTS["tables_from"] == "int4_domains" and "tables" not in RESULTS  # computed when rendered
    page = (ROOT / "docs" / "results" / "int4_domains.md").read_text()
    for made in quality.domain_tables(raw):
        assert all("| " + " | ".join(row) + " |" in page for row in made["rows"])
    for heading in quality.SET_HEADINGS.values():
        assert heading in page


def per_text_range(build: str, chosen: str) -> str:
    """The range of `build`'s per-text perplexity change against fp32 over one set, as the page writes it."""
    runs, texts = RESULTS["raw"]["runs"], RESULTS["raw"]["texts"]
    changes = [
        runs[build][t]["perplexity"] / runs["fp32"][t]["perplexity"] - 1 for t in texts if texts[t]["set"] == chosen
    ]
    return f"{min(changes):+.1%} to {max(changes):+.1%}"


@pytest.mark.parametrize("document", ["README.md", "docs/deployment.md"])
def test_the_int4_quality_sentence_quotes_the_tuning_and_held_out_ranges(document):
    text = (ROOT / document).read_text()
    # The paragraph, or the README list's item, that links the page.
    paragraph = next(block for block in re.split(r"\n\s*\n|\n- ", text) if "int4_domains.md" in block)
    paragraph = " ".join(paragraph.split())
    for build in ("int4", "int8"):
        for chosen in (int4_domains.TUNING, int4_domains.HELD_OUT):
            assert per_text_range(build, chosen).replace("+", "") in paragraph.replace("+", ""), (build, chosen)
    assert "held-out" in paragraph and "tuning" in paragraph


@pytest.mark.parametrize("engine", ["llamacpp", "openvino"])
def test_other_engines_builds_score_the_reference_tokenizers_ids_in_vaswanis_windows(engine, tmp_path, monkeypatch):
    """`--gguf` and `--openvino-genai` builds are scored by their engine (its helper, in its venv) on the token ids
    that vaswani's own perplexity reads (the reference build's tokenizer, no special tokens) and in the same windows;
    a build's bytes are its whole weights file (the tied head is the embedding table)."""
    import argparse

    from serving_cases import tiny_chat_tokenizer

    from benchmarks import engine_perplexity
    from vaswani.evaluation.perplexity import text_ids

    tokenizer = tiny_chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "reference")
    if engine == "llamacpp":
        build = tmp_path / "model.gguf"
        build.write_bytes(b"\0" * 1234)
        entry = int4_domains.gguf_build(str(build))
    else:
        build = tmp_path / "openvino-int8"
        build.mkdir()
        (build / "openvino_model.bin").write_bytes(b"\0" * 1234)
        entry = int4_domains.openvino_genai_build(str(build))
    calls = []

    def scores(python, helper, location, request, context, stride):
        assert python == tmp_path / "engines" / engine / "bin" / "python"
        assert helper == {"llamacpp": "gguf_tools.py", "openvino": "openvino_tools.py"}[engine]

        def measure(ids):
            calls.append((location, request, context, stride, ids))
            return {"perplexity": 2.0, "mean_nll": math.log(2.0), "tokens": len(ids) - 1}

        return measure

    monkeypatch.setattr(engine_perplexity, "engine_scores", scores)
    texts = {"a": "Once upon a time there was a cat.", "b": "The cat sat on the mat."}
    args = argparse.Namespace(threads=2, context=16, stride=8, engines=tmp_path / "engines")
    runs = int4_domains.score_engine_builds(engine, {"q": str(build)}, texts, str(tmp_path / "reference"), args)
    assert [call[4] for call in calls] == [text_ids(tokenizer, text) for text in texts.values()]
    assert all(call[0] == build and call[1]["threads"] == 2 and call[2:4] == (16, 8) for call in calls)
    assert all(call[1].get("flash_attn", engine != "llamacpp") for call in calls)  # llama.cpp's CPU default: on
    assert set(runs["q"]) == set(texts) and runs["q"]["a"]["tokens"] == len(calls[0][4]) - 1
    assert entry["weight_bytes"] == 1234


def test_openvino_builds_are_scored_by_the_openvino_engine_and_labelled_so(tmp_path, monkeypatch):
    """`--openvino-build` scores its folder with engine="openvino" (every window a prompt, so OpenVINO's arithmetic),
    `--build` with ONNX Runtime, and the JSON says which engine scored each build."""
    import sys

    from vaswani.evaluation import perplexity

    scored, published = [], {}

    class Result:
        perplexity, mean_nll, tokens = 2.0, math.log(2.0), 10

        def describe(self):
            return "perplexity 2.0"

    def fake_perplexity(folder, text, engine="onnxruntime", **kwargs):
        scored.append((folder, engine))
        return Result()

    monkeypatch.setattr(perplexity, "folder_perplexity", fake_perplexity)
    monkeypatch.setattr(int4_domains, "tuning_texts", lambda: {"technical": "Some text."})
    monkeypatch.setattr(int4_domains, "held_out_texts", lambda: {"news": "Other text."})
    monkeypatch.setattr(int4_domains, "describe_build", lambda folder: f"export {folder}")
    monkeypatch.setattr(int4_domains, "decoder_weight_bytes", lambda folder: 100)
    monkeypatch.setattr(int4_domains, "publish", lambda raw, *rest: published.update(raw) or "page")
    arguments = ["--build", "fp32=/a", "--openvino-build", "int8 ov=/b", "--json", str(tmp_path / "out.json")]
    monkeypatch.setattr(sys, "argv", ["int4_domains", *arguments])
    int4_domains.main()
    assert sorted(set(scored)) == [("/a", "onnxruntime"), ("/b", "openvino")]
    assert (
        published["builds"]["int8 ov"]["engine"] == "openvino"
        and published["builds"]["fp32"]["engine"] == "onnxruntime"
    )
    assert published["builds"]["int8 ov"]["build"].endswith("run by --engine openvino")


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_the_cache_quality_page_refuses_a_default_run_with_one_cache_type_and_names_the_fix(
    precision, tmp_path, monkeypatch, capsys
):
    """Without --precisions, kv_cache_quality.py compares float32 and float16 caches at OpenVINO's own compute
    precision; where that is bf16 (a CPU with AVX512_BF16 or AMX) the paged attention takes only bfloat16, so the
    run stops at once with the two ways to run it, before loading anything. At f32 it goes on to load the folder."""
    import sys

    import transformers

    pytest.importorskip("openvino")
    from benchmarks import kv_cache_quality
    from vaswani.runtime import openvino

    class Loading(Exception):
        pass

    def load(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(openvino, "openvino_precision", lambda requested="auto": precision)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)
    monkeypatch.setattr(sys, "argv", ["kv_cache_quality", "--folder", str(tmp_path), "--json", str(tmp_path / "j")])
    if precision == "f32":
        with pytest.raises(Loading):
            kv_cache_quality.main()
        return
    with pytest.raises(SystemExit) as raised:
        kv_cache_quality.main()
    assert raised.value.code == 2 and "--precisions f32" in capsys.readouterr().err
