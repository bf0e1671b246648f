"""`vaswani bench`: well-formed results on a tiny PyTorch folder and its ONNX export, weight bytes equal to an
independent count of the saved tensors, and clear errors for settings that time nothing. Nothing here asserts a time:
the machine is shared."""

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vaswani.cli.main import main as vaswani_cli
from vaswani.evaluation.speed import BenchResult, BenchRow

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
    initializers (loaded with their external data), less the tables a decode step reads one row of: each saved
    embedding table unless a tied LM head reads it whole, and the rotary cos/sin tables (one row per position, of
    the config's positions by half a head) that the GroupQueryAttention form stores. A float graph's tied head reads
    the table itself (MatMul of its Transpose); a quantized graph's head is its own 8-bit copy, so there the table
    is looked up only."""
    tables = embedding_tables(pytorch_folder)
    config = json.loads((pytorch_folder / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary_table = (config["max_position_embeddings"], head_dim // 2)
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
        if array.shape != rotary_table
        and not any(array.shape == table.shape and np.array_equal(array, table) for table in tables.values())
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


PROBE_ELEMENTS = 1024 * 2**20 // 4  # the bandwidth probe's buffer: `vaswani bench` sums 1 GiB of float32


@pytest.mark.parametrize("form, engine", [("pytorch", None), ("onnx", "onnxruntime"), ("onnx", "openvino")])
def test_the_bandwidth_probe_reads_on_the_threads_the_decode_computes_on(
    folders, form: str, engine: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is bandwidth / weight bytes, so the bandwidth must be read on the threads the decode computes on:
    read on fewer, it understates what the decode can reach (a 2-thread decode was published at 108% of a bound read
    on one thread). For an ONNX folder the command gives torch one thread (`set_command_threads`) and the decode
    runs on `--threads` (ONNX Runtime's intra-op threads, which the OpenVINO route is given too). Observed from
    outside: torch's thread count while the probe's buffer is summed, against the `--threads` asked for."""
    if engine == "openvino":
        pytest.importorskip("openvino")
    threads_while_probing = []
    summed = torch.Tensor.sum

    def watched_sum(tensor: torch.Tensor, *args, **kwargs):
        if tensor.numel() == PROBE_ELEMENTS:
            threads_while_probing.append(torch.get_num_threads())
        return summed(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", watched_sum)
    output = tmp_path / "bench.json"
    flags = ["--engine", engine] if engine else []
    settings = ["--prompt-tokens", "4", "--new-tokens", "2", "--rounds", "1", "--batch-sizes", "1"]
    assert vaswani_cli(["bench", str(folders[form]), *settings, *flags, "--threads", "2", "--json", str(output)]) == 0
    result = json.loads(output.read_text())
    assert threads_while_probing and set(threads_while_probing) == {2}
    assert result["bandwidth_threads"] == result["machine"]["threads"] == 2
    # The probe borrows torch's pool and gives it back: an ONNX folder's torch keeps its one thread.
    assert torch.get_num_threads() == (1 if form == "onnx" else 2)


def bench_round(bandwidth: float, decode_rates: dict[int, float], weights: int = 1000) -> dict:
    """One `vaswani bench --json` result as the command writes it, with these figures."""
    bound = bandwidth / weights
    rows = [BenchRow(batch, 8, 4, batch * 4, 0.1, rate, rate / batch / bound) for batch, rate in decode_rates.items()]
    machine = {"cpu": "test", "cores": 2, "threads": 2, "torch": "CPU (1 thread)"}
    return {
        **asdict(BenchResult("folder", "onnx", "cpu", machine, weights, bandwidth, bound, 1, rows)),
        "bandwidth_threads": 2,
    }


def test_a_summary_row_takes_its_bound_from_the_round_it_takes_its_rate_from() -> None:
    """`benchmark_gpu.summarize` (also the CPU reference benchmark's) keeps each row's best round; that round's
    fraction must be of the bound printed beside it. Here the rounds' bandwidths differ and the best rate of batch 1
    and of batch 8 come from different rounds."""
    from benchmarks.benchmark_gpu import summarize

    runs = {"build": [bench_round(20_000.0, {1: 5.0, 8: 30.0}), bench_round(10_000.0, {1: 6.0, 8: 24.0})]}
    rows = {row["batch_size"]: row for row in summarize(runs)}
    assert rows[1]["decode_tokens_per_s"] == 6.0 and rows[1]["bound_tokens_per_s"] == 10.0
    assert rows[8]["decode_tokens_per_s"] == 30.0 and rows[8]["bound_tokens_per_s"] == 20.0
    for batch, row in rows.items():
        assert row["bound_fraction"] == pytest.approx(row["decode_tokens_per_s"] / batch / row["bound_tokens_per_s"])
    assert all(row["bandwidth_threads"] == row["decode_threads"] == 2 for row in rows.values())


def test_weight_bytes_of_a_quantized_graph_count_its_packed_initializers(folders, tmp_path: Path) -> None:
    """An int8 export's count is of what its graph stores (packed weights, scales, zero points), fewer bytes than
    fp32's (not a quarter: this tiny model's fp32 embedding table is a large part of it)."""
    from vaswani.evaluation.speed import weight_bytes
    from vaswani.export import export_onnx
    from vaswani.runtime.loading import load_folder

    folder = tmp_path / "int8"
    export_onnx(folders["pytorch"], folder, task="text-generation", quantize="int8", validate=False)
    quantized = weight_bytes(load_folder(folder))
    assert quantized == saved_weight_bytes(folder, folders["pytorch"])
    assert quantized < saved_weight_bytes(folders["onnx"], folders["pytorch"])


def test_weight_bytes_leave_out_the_rotary_tables_of_the_group_query_attention_form(tmp_path: Path) -> None:
    """A quantized Llama export is in ONNX Runtime's GroupQueryAttention form, which stores cos/sin tables of every
    position that a step reads one row of: counting them would overstate a Llama-3.2-1B int4 step by 34 MB."""
    from serving_cases import tiny_chat_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from vaswani.evaluation.speed import lookup_tables, weight_bytes
    from vaswani.export import export_onnx
    from vaswani.runtime.contract import is_gqa_form
    from vaswani.runtime.loading import load_folder

    torch.manual_seed(0)
    tokenizer = tiny_chat_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    folder = tmp_path / "int8"
    export_onnx(tmp_path / "llama", folder, task="text-generation", quantize="int8", validate=False)
    loaded = load_folder(folder)
    assert is_gqa_form(loaded.model.manifest)
    assert {"gqa.cos_cache", "gqa.sin_cache"} <= lookup_tables(folder / "model.onnx")
    assert weight_bytes(loaded) == saved_weight_bytes(folder, tmp_path / "llama")


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


def test_the_reference_page_withdraws_fractions_of_a_bound_read_on_other_threads() -> None:
    """A row of a run from before the probe recorded its threads (the probe then read on torch's one thread while
    ONNX Runtime decoded on two) shows no bound and no fraction; a row probed on its decode's threads shows both."""
    from benchmarks.results.speed import reference_cpu_tables

    old = bench_round(10_000.0, {1: 11.0})
    del old["bandwidth_threads"]
    raw = {
        "settings": {"rounds": 1, "bench_rounds": 1, "batch_sizes": [1], "prompt_tokens": 8, "new_tokens": 4},
        "builds": {"old-build": "a build", "new-build": "a build"},
        "runs": {"old-build": [old], "new-build": [bench_round(10_000.0, {1: 6.0})]},
    }
    decode = next(made for made in reference_cpu_tables(raw, {}) if made["heading"] == "Decode")
    rows = {row[0]: row for row in decode["rows"]}
    assert rows["old-build"][-2:] == ["withdrawn", "withdrawn"] and "110.0%" not in rows["old-build"]
    assert rows["new-build"][-2:] == ["10.00 tokens/s", "60.0%"]
