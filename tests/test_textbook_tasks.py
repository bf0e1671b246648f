"""The textbook experiments (`examples/train_pattern_classification.py`, `examples/train_string_reversal.py`) run end
to end: shortened versions train with `Trainer`, drive the training loss far below chance, and write the saved
model, figures and results they promise.

The full runs (minutes on a CPU) reproduce the textbook's numbers; these take seconds and only check that learning
happens and every output is written. Each script is imported from its file and its `main(argv)` called in-process.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification

ROOT = Path(__file__).resolve().parents[1]
# Where runnable files live: the examples, the benchmarks and the developer scripts.
SCRIPT_FOLDERS = [ROOT / "examples", ROOT / "benchmarks", ROOT / "scripts"]


def load_script(name: str) -> ModuleType:
    path = next(folder / f"{name}.py" for folder in SCRIPT_FOLDERS if (folder / f"{name}.py").is_file())
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pattern_classification(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("pattern_classification")
    # The textbook task at a smaller scale: 4 classes, sequences of 16 tokens, a 2-layer encoder, 128 steps.
    flags = "--train-size 2048 --eval-size 256 --epochs 4 --num-classes 4 --seq-length 16 --hidden-size 64"
    flags += " --num-layers 2 --intermediate-size 128 --warmup-steps 10 --learning-rate 3e-3"
    argv = ["--output-dir", str(output_dir), *flags.split()]
    return load_script("train_pattern_classification").main(argv), output_dir


@pytest.fixture(scope="module")
def string_reversal(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    output_dir = tmp_path_factory.mktemp("string_reversal")
    # Strings of 3 to 6 letters and a gentler learning rate: 300 steps leave the loss plateau for every seed tried.
    flags = "--steps 300 --batch-size 32 --max-length 6 --learning-rate 1e-3 --warmup-steps 30"
    flags += " --eval-size 50 --eval-every 150"
    argv = ["--output-dir", str(output_dir), *flags.split()]
    return load_script("train_string_reversal").main(argv), output_dir


def test_pattern_classification_loss_falls_far_below_chance(pattern_classification: tuple[dict, Path]) -> None:
    results, _ = pattern_classification
    assert results["final_train_loss"] < 0.5 * math.log(4), results["final_train_loss"]
    assert results["validation_accuracy"] > 0.5


def test_pattern_classification_writes_model_figure_and_results(pattern_classification: tuple[dict, Path]) -> None:
    results, output_dir = pattern_classification
    assert (output_dir / "model" / "model.safetensors").is_file()
    assert (output_dir / "loss_curve.png").stat().st_size > 0
    assert (
        json.loads((output_dir / "results.json").read_text())["validation_accuracy"] == results["validation_accuracy"]
    )
    assert "| validation accuracy" in (output_dir / "results.md").read_text()
    model = AutoModelForSequenceClassification.from_pretrained(output_dir / "model").eval()
    assert model.config.classifier_pooling == "mean" and model.config.num_labels == 4


@pytest.mark.slow  # 300 training steps: the loss oracle needs them
def test_string_reversal_loss_falls_far_below_chance(string_reversal: tuple[dict, Path]) -> None:
    results, _ = string_reversal
    assert results["final_train_loss"] < 0.5 * math.log(len(results["vocab"])), results["final_train_loss"]
    assert [row["length"] for row in results["per_length"]] == [3, 5, 7, 10, 15]


@pytest.mark.slow  # 300 training steps: the loss oracle needs them
def test_string_reversal_writes_model_figures_and_results(string_reversal: tuple[dict, Path]) -> None:
    results, output_dir = string_reversal
    for figure in ("loss_curve.png", "cross_attention.png"):
        assert (output_dir / figure).stat().st_size > 0
    assert "| 15 (longer than any training string) |" in (output_dir / "results.md").read_text()
    model = AutoModelForSeq2SeqLM.from_pretrained(output_dir / "model").eval()
    # The saved generation config knows the special tokens: decoding starts with `<s>`.
    output = model.generate(torch.tensor([[5, 6, 7, 2]]), max_new_tokens=4)
    assert output[0, 0].item() == model.config.decoder_start_token_id == 1


def test_string_reversal_vocabulary_and_encoding() -> None:
    script = load_script("train_string_reversal")
    batch = script.encode(["abc", "hello"])
    assert script.decode(batch["input_ids"][0].tolist()) == "abc"
    assert script.decode(batch["labels"][1].clamp(min=0).tolist()) == "olleh"
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 1, 0, 0]
    assert batch["labels"][0].tolist()[-2:] == [-100, -100]


def test_pattern_classification_labels_are_unambiguous() -> None:
    script = load_script("train_pattern_classification")
    generator = torch.Generator().manual_seed(0)
    patterns = script.make_patterns(10, 5, 100, generator)
    assert len(set(patterns.flatten().tolist())) == 50  # no token shared between two patterns
    input_ids, labels = script.make_dataset(2000, patterns, 64, 100, generator)
    found = script.contained_patterns(input_ids, patterns)
    assert found.sum(1).eq(1).all() and found[torch.arange(2000), labels].all()
