"""`examples/extrapolation_study.py` runs end to end in its quick mode and writes well-formed results: a CSV with a
row for every encoding, length and metric, a markdown table, and readable figures. The numbers of a quick run mean
nothing (tiny models, four steps); only their form is checked here, plus the two evaluation pieces whose behaviour
can be pinned down exactly: RoPE scalings set at inference, and sliding-window perplexity."""

import csv
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
from test_textbook_tasks import load_script

from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
from vaswani.modeling.configuration import POSITION_EMBEDDING_TYPES


@pytest.fixture(scope="module")
def study() -> ModuleType:
    return load_script("extrapolation_study")


@pytest.fixture(scope="module")
def quick_run(study: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    output = tmp_path_factory.mktemp("extrapolation")
    # One thread: the suite's setting (conftest), which the script would otherwise change for later tests.
    study.main(["--quick", "--threads", "1", "--output", str(output)])
    with (output / "results.csv").open(newline="") as handle:
        return list(csv.DictReader(handle)), output


def test_quick_run_writes_a_csv_row_for_every_encoding_length_and_metric(study, quick_run) -> None:
    rows, output = quick_run
    with (output / "results.csv").open(newline="") as handle:
        assert tuple(next(csv.reader(handle))) == study.CSV_COLUMNS
    decoder, reversal = study.QUICK_DECODER, study.QUICK_REVERSAL
    decoder_lengths = {multiple * decoder.train_length for multiple in decoder.length_multiples}
    for encoding in POSITION_EMBEDDING_TYPES:
        for evaluation in ("full", "sliding"):
            lengths = {int(r["eval_length"]) for r in rows if (r["task"], r["encoding"], r["evaluation"],
                                                                r["rope_scaling"]) == ("decoder", encoding, evaluation, "")}
            assert lengths == decoder_lengths, (encoding, evaluation)
        for metric in ("token_accuracy", "exact_match"):
            lengths = {int(r["eval_length"]) for r in rows if (r["task"], r["encoding"], r["metric"]) == ("reversal", encoding, metric)}
            assert lengths == set(reversal.eval_lengths), (encoding, metric)
    for scaling in study.ROPE_SCALINGS:
        scaled = [r for r in rows if r["rope_scaling"] == scaling]
        assert {int(r["eval_length"]) for r in scaled} == decoder_lengths, scaling
        assert {r["encoding"] for r in scaled} == {"rope"}


def test_every_value_is_a_number_or_says_why_not(quick_run) -> None:
    rows, _ = quick_run
    for row in rows:
        if row["value"]:
            value = float(row["value"])
            assert math.isfinite(value), row
            if row["metric"] == "perplexity":
                assert value >= 1.0, row
            if row["metric"] in ("token_accuracy", "exact_match"):
                assert 0.0 <= value <= 1.0, row
        else:
            # Only learned positions past their table, full-context, have no value; sliding windows always do.
            assert row["encoding"] == "learned" and row["evaluation"] != "sliding", row
            assert row["note"].startswith("n/a (table ends at"), row
            assert int(row["eval_length"]) > int(row["train_length"]), row


def test_learned_positions_are_reported_past_their_table_not_crashed(quick_run) -> None:
    rows, _ = quick_run
    learned_full = [r for r in rows if (r["task"], r["encoding"], r["evaluation"]) == ("decoder", "learned", "full")]
    within = [r for r in learned_full if int(r["eval_length"]) <= int(r["train_length"])]
    beyond = [r for r in learned_full if int(r["eval_length"]) > int(r["train_length"])]
    assert within and all(r["value"] for r in within)
    assert beyond and all(not r["value"] and r["note"] == f"n/a (table ends at {r['train_length']})" for r in beyond)


def test_markdown_has_well_formed_tables_with_a_row_for_every_encoding(quick_run) -> None:
    _, output = quick_run
    tables, current = [], []
    for line in [*(output / "results.md").read_text().splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    # Decoder full context and sliding window; string reversal token accuracy and exact match.
    assert len(tables) == 4
    for header, separator, *body in tables:
        assert set(separator) <= set("|-") and separator.count("|") == header.count("|")
        assert all(line.count("|") == header.count("|") for line in body), header
        names = [line.split("|")[1].strip() for line in body]
        assert set(POSITION_EMBEDDING_TYPES) <= set(names), header
    assert [f"rope + {scaling}" for scaling in ("linear", "dynamic", "yarn")] == [
        line.split("|")[1].strip() for line in tables[0] if line.startswith("| rope + ")
    ]


def test_figures_are_readable_pngs(quick_run) -> None:
    import matplotlib.pyplot as plt

    _, output = quick_run
    for name in ("decoder_perplexity.png", "reversal_accuracy.png"):
        image = plt.imread(output / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name


def tiny_rope_model(train_length: int) -> VaswaniForCausalLM:
    torch.manual_seed(0)
    config = VaswaniDecoderConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        position_embedding_type="rope", max_position_embeddings=train_length, initializer_range=0.2,
    )
    return VaswaniForCausalLM(config).eval()


@pytest.mark.parametrize("scaling", ["linear", "dynamic", "yarn"])
def test_rope_scaling_set_at_inference_changes_the_model_past_the_training_length(study, scaling: str) -> None:
    model, train_length = tiny_rope_model(train_length=16), 16
    scaled = study.with_rope_scaling(model, scaling, factor=2)
    assert scaled.config.rope_parameters["rope_type"] == scaling
    ids = torch.randint(0, 64, (1, 2 * train_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, scaled(ids).logits)
    study.check_rope_scaling_applies(model, scaled, 2 * train_length, scaling)
    with pytest.raises(RuntimeError, match="did not change"):
        study.check_rope_scaling_applies(model, model, 2 * train_length, scaling)


def test_dynamic_rope_leaves_sequences_within_the_training_length_unchanged(study) -> None:
    model, train_length = tiny_rope_model(train_length=16), 16
    scaled = study.with_rope_scaling(model, "dynamic", factor=2)
    ids = torch.randint(0, 64, (2, train_length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(scaled(ids).logits, model(ids).logits)


def test_sliding_window_of_the_whole_length_is_full_context_perplexity(study) -> None:
    model = tiny_rope_model(train_length=16)
    tokens = torch.randint(0, 64, (64,), generator=torch.Generator().manual_seed(2))
    full = study.full_context_perplexity(model, tokens, 16)
    assert study.sliding_window_perplexity(model, tokens, 16, window=16) == pytest.approx(full, rel=1e-6)


def test_sliding_window_predicts_each_token_once_from_its_latest_window(study) -> None:
    model, window, length = tiny_rope_model(train_length=16), 16, 32
    tokens = torch.randint(0, 64, (2 * length,), generator=torch.Generator().manual_seed(3))
    # Oracle, token by token: token t (t >= 1) of a sequence is predicted by the first window (start 0) while
    # t < window, else by the window of stride window/2 that ends with it in its second half.
    stride, log_probs = window // 2, []
    with torch.no_grad():
        for sequence in tokens.view(-1, length):
            for t in range(1, length):
                start = 0 if t < window else stride * ((t - window) // stride + 1)
                logits = model(sequence[None, start : start + window]).logits[0, t - start - 1]
                log_probs.append(torch.log_softmax(logits.float(), -1)[sequence[t]].item())
    expected = math.exp(-sum(log_probs) / len(log_probs))
    assert study.sliding_window_perplexity(model, tokens, length, window) == pytest.approx(expected, rel=1e-5)
