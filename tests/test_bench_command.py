"""`vaswani bench`: well-formed results on a tiny PyTorch folder and its ONNX export, weight bytes equal to an
independent count of the saved tensors, and clear errors for settings that time nothing. Nothing here asserts a time:
the machine is shared."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from vaswani.cli import main as vaswani_cli

onnx = pytest.importorskip("onnx")

SETTINGS = ["--prompt-tokens", "8", "--new-tokens", "4", "--rounds", "1", "--batch-sizes", "1", "3"]


@pytest.fixture
def folders(tiny_chat_pair: dict[str, Path]) -> dict[str, Path]:
    return tiny_chat_pair


def embedding_tables(folder: Path) -> dict[str, np.ndarray]:
    """The saved embedding tables (token, learned positions) of a PyTorch folder, by name."""
    with safe_open(folder / "model.safetensors", "np") as tensors:
        return {name: tensors.get_tensor(name) for name in tensors.keys() if "embed" in name}


def saved_weight_bytes(folder: Path, pytorch_folder: Path) -> int:
    """The oracle: the bytes of the tensors stored in the folder's safetensors, or in its decoding graph's
    initializers (loaded with their external data), less the embedding tables a decode step reads one row of: each
    saved table unless a tied LM head reads it whole. A float graph's tied head reads the table itself (MatMul of
    its Transpose); a quantized graph's head is its own 8-bit copy, so there the table is looked up only."""
    tables = embedding_tables(pytorch_folder)
    tied = json.loads((pytorch_folder / "config.json").read_text()).get("tie_word_embeddings", False)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        with safe_open(folder / "model.safetensors", "pt") as tensors:
            return sum(
                tensors.get_tensor(name).nbytes
                for name in tensors.keys()
                if name not in tables or (tied and "embed_tokens" in name)
            )
    manifest = json.loads(manifest.read_text())
    if tied and manifest["quantization"] is None:
        tables = {name: table for name, table in tables.items() if "embed_tokens" not in name}
    model = onnx.load(str(folder / manifest["graphs"]["model"]["file"]), load_external_data=True)
    arrays = [onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer]
    return sum(
        array.nbytes
        for array in arrays
        if not any(array.shape == table.shape and np.array_equal(array, table) for table in tables.values())
    )


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
    assert result["weight_bytes"] == saved_weight_bytes(folders[form], folders["pytorch"])
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
    assert quantized == saved_weight_bytes(folder, folders["pytorch"])
    assert quantized < saved_weight_bytes(folders["onnx"], folders["pytorch"])


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
