"""`vaswani bench`: well-formed results on a tiny PyTorch folder and its ONNX export, weight bytes equal to an
independent count of the saved tensors, and clear errors for settings that time nothing. Nothing here asserts a time:
the machine is shared."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from vaswani.cli import main as vaswani_cli

onnx = pytest.importorskip("onnx")

SETTINGS = ["--prompt-tokens", "8", "--new-tokens", "4", "--rounds", "1", "--batch-sizes", "1", "3"]


@pytest.fixture
def folders(tiny_chat_pair: dict[str, Path]) -> dict[str, Path]:
    return tiny_chat_pair


def saved_weight_bytes(folder: Path) -> int:
    """The oracle: the bytes of the tensors stored in the folder's safetensors, or in its decoding graph's
    initializers (loaded with their external data)."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        with safe_open(folder / "model.safetensors", "pt") as tensors:
            return sum(tensors.get_tensor(name).nbytes for name in tensors.keys())
    graph_file = json.loads(manifest.read_text())["graphs"]["model"]["file"]
    model = onnx.load(str(folder / graph_file), load_external_data=True)
    return sum(onnx.numpy_helper.to_array(tensor).nbytes for tensor in model.graph.initializer)


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_bench_writes_rows_for_every_batch_size(
    folders, form: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    output = tmp_path / "bench.json"
    assert vaswani_cli(["bench", str(folders[form]), *SETTINGS, "--threads", "1", "--json", str(output)]) == 0
    table = capsys.readouterr().out
    result = json.loads(output.read_text())
    assert result["form"] == form and result["rounds"] == 1
    assert [row["batch_size"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["generated_tokens"] == row["batch_size"] * 4 and row["prompt_tokens"] == 8
        assert row["time_to_first_token_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["bound_fraction"] > 0
    assert result["weight_bytes"] == saved_weight_bytes(folders[form])
    assert result["bandwidth_bytes_per_s"] > 0
    assert result["bound_tokens_per_s"] == pytest.approx(result["bandwidth_bytes_per_s"] / result["weight_bytes"])
    assert result["machine"]["threads"] == 1 and result["machine"]["cores"] >= 1
    assert "| 3 | 8 | 4 |" in table and result["machine"]["cpu"] in table


def test_weight_bytes_of_a_quantized_graph_count_its_packed_initializers(folders, tmp_path: Path) -> None:
    """An int8 export's count is of what its graph stores (packed weights, scales, zero points), fewer bytes than
    fp32's (not a quarter: this tiny model's fp32 embedding table is a large part of it)."""
    from vaswani.benchmarking import weight_bytes
    from vaswani.conversion.onnx import export_onnx
    from vaswani.loading import load_folder

    folder = tmp_path / "int8"
    export_onnx(folders["pytorch"], folder, task="text-generation", quantize="int8", validate=False)
    quantized = weight_bytes(load_folder(folder))
    assert quantized == saved_weight_bytes(folder)
    assert quantized < saved_weight_bytes(folders["onnx"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--new-tokens", "1"], "--new-tokens"),
        (["--rounds", "0"], "--rounds"),
        (["--prompt-tokens", "0"], "--prompt-tokens"),
    ],
)
def test_bad_flags_are_argparse_errors(folders, flags, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        vaswani_cli(["bench", str(folders["pytorch"]), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_context_overflow_and_non_generation_folders_are_refused(
    folders, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert vaswani_cli(["bench", str(folders["onnx"]), "--prompt-tokens", "4000", "--new-tokens", "4"]) == 2
    assert "context" in capsys.readouterr().err
    assert vaswani_cli(["bench", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
