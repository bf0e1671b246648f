"""The profiler's summary (`benchmarks/profile_decode.py`) on a trace made by hand: decode steps and, with
`--prompt-step`, the prompt's run, each split into weight products, attention, other nodes, ONNX Runtime's own time
per run and the loop between runs, with the weight products' read rate from the graph's weight bytes."""

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from benchmarks.profile_decode import summarize  # noqa: E402
from vaswani.runtime.contract import save_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(start: float, duration: float) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": start, "dur": duration}


def kernel(node: str, op: str, start: float, duration: float) -> dict:
    return {"cat": "Node", "name": f"{node}_kernel_time", "ts": start, "dur": duration, "args": {"op_name": op}}


@pytest.fixture
def traced(tmp_path):
    """A graph with one weight product (a 64 x 64 float32 weight: 16384 bytes) and a trace of three runs: the
    prompt's, then two decode steps."""
    weight = numpy_helper.from_array(np.ones((64, 64), dtype=np.float32), "weight")
    nodes = [
        helper.make_node("MatMul", ["x", "weight"], ["product"], name="projection"),
        helper.make_node("Relu", ["product"], ["y"], name="activation"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    graph_path = tmp_path / "model.onnx"
    save_graph(helper.make_model(graph), graph_path)
    events = [
        run(0, 1000),
        kernel("projection", "MatMul", 10, 600),
        kernel("activation", "Relu", 700, 100),
        run(2000, 300),
        kernel("projection", "MatMul", 2010, 200),
        kernel("activation", "Relu", 2220, 20),
        run(2500, 300),
        kernel("projection", "MatMul", 2510, 150),
    ]
    trace_path = tmp_path / "trace.json"
    trace_path.write_text(json.dumps(events))
    return trace_path, graph_path


def test_a_decode_step_is_split_into_its_parts_and_the_loop_after_it(traced):
    summary = summarize(*traced, skip=0)  # the first decode step; the last run has no next start
    assert summary["steps"] == 1
    assert (summary["weight products"], summary["other nodes"], summary["attention"]) == (200, 20, 0)
    assert summary["run overhead"] == 300 - 220 and summary["loop"] == 2500 - 2300
    assert summary["GB/s"] == pytest.approx(16384 / 200e-6 / 1e9)


def test_the_prompt_step_is_the_first_run_with_no_loop(traced):
    summary = summarize(*traced, skip=0, prompt_step=True)
    assert summary["steps"] == 1
    assert (summary["weight products"], summary["other nodes"], summary["loop"]) == (600, 100, 0)
    assert summary["run overhead"] == 1000 - 700


@pytest.mark.parametrize("batch", [None, 8])
def test_the_page_names_the_batch_it_profiled(batch):
    """Pages made before `--batch` have no batch in their settings: they profiled batch 1."""
    from benchmarks.results.engines import PROFILE_PARTS, profile_tables

    settings = {"prompt": 47, "new_tokens": 16, "threads": 2, "rounds": 1, "skip": 4, "prompt_step": False}
    if batch:
        settings["batch"] = batch
    summary = dict.fromkeys(PROFILE_PARTS, 100.0) | {"GB/s": 1.0, "steps": 11}
    (made,) = profile_tables({"settings": settings, "rounds": {"int4": [summary]}}, {})
    assert f"Decode steps at batch {batch or 1} after a 47-token prompt" in made["text"][0]
