"""Tracing: each graph of a model with `torch.onnx.export(dynamo=True)` in the export-only formulations
(`formulations.py`), stamped from a two-layer trace where the model is deeper and stamping is safe (`stamping.py`),
its axes named as the contract says (`runtime.contract`). `exporter.py` calls `trace_graphs` once per model.
"""

import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import onnx_ir
import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..runtime.contract import PAST_PLUS_SEQUENCE, Decision, GraphSpec, TensorSpec, example_inputs
from .formulations import LLM_OPSET, exporting_formulations, fuse_sibling_matmuls
from .stamping import TEMPLATE_LAYERS, StampingRefused, stamped_graphs, stamping_depths
from .wrappers import build_graph_specs

# Sizes of the dynamic axes while tracing: all >= 2 and all different, so that torch.export neither specializes an
# axis to 0/1 nor unifies two axes that merely happen to be equal.
TRACE_SIZES = {"batch": 2, "sequence": 3, "past_sequence": 4, "encoder_sequence": 5, "logits_sequence": 6}


logger = logging.getLogger(__name__)

# Loading, building and tracing a model touch torch's process-wide state: torch.export keeps its tracing modes on one
# stack for the process ("Trying to pop empty mode stack" when two trace at once), loading builds the model with
# parameter registration patched to the meta device (a parameter another thread creates meanwhile lands there), and
# the exporter's quieting sets a logger and the warnings filters. So these steps of two exports take turns; the
# rest (quantization, validation) runs side by side.
TORCH_GLOBALS = threading.RLock()


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's chatter (missing torchvision ops, axis-renaming notes); errors still raise."""
    exporter_logger = logging.getLogger("torch.onnx")
    level = exporter_logger.level
    exporter_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        exporter_logger.setLevel(level)


def export_graph(spec: GraphSpec, config: PreTrainedConfig, device: str, opset: int | None) -> onnx_ir.Model:
    """Trace one graph with `torch.onnx.export(dynamo=True)` and name its axes as the spec says."""
    return finish_graph(trace_graph(spec, config, device, opset), spec)


def trace_graph(spec: GraphSpec, config: PreTrainedConfig, device: str, opset: int | None) -> onnx_ir.Model:
    """`torch.onnx.export(dynamo=True)` of one graph, with the exporter's node metadata (module scopes) kept."""
    generator = torch.Generator().manual_seed(0)
    tensors = example_inputs(spec.inputs, TRACE_SIZES, config, generator)
    tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    dims = {name: torch.export.Dim(name) for name in TRACE_SIZES}
    # The mask length is past + sequence; torch.export infers that relation itself.
    dims[PAST_PLUS_SEQUENCE] = torch.export.Dim.DYNAMIC

    def structured(make: Callable[[TensorSpec], object]) -> tuple:
        return tuple(
            None
            if argument is None
            else tuple(make(leaf) for leaf in argument)
            if isinstance(argument, tuple)
            else make(argument)
            for argument in spec.arguments
        )

    args = structured(lambda leaf: tensors[leaf.name])
    dynamic_shapes = structured(
        lambda leaf: {axis: dims[name] for axis, name in enumerate(leaf.shape) if isinstance(name, str)}
    )
    llm_ops = opset is not None and opset >= LLM_OPSET
    with TORCH_GLOBALS, torch.no_grad(), exporting_formulations(spec.module, llm_ops), _quiet_exporter():
        program = torch.onnx.export(
            spec.module,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=[leaf.name for leaf in spec.inputs],
            output_names=[leaf.name for leaf in spec.outputs],
            opset_version=opset,
            optimize=True,
            verbose=False,
        )
    return program.model


def finish_graph(model: onnx_ir.Model, spec: GraphSpec) -> onnx_ir.Model:
    """A traced (or stamped) graph as it ships: metadata dropped, sibling MatMuls fused, axes named as the spec says."""
    for node in model.graph.all_nodes():
        # The exporter annotates nodes with stack traces and local source paths: not for a shipped artifact.
        node.metadata_props.clear()
    fuse_sibling_matmuls(model)
    _name_axes(model.graph.inputs, spec.inputs, spec.name)
    _name_axes(model.graph.outputs, spec.outputs, spec.name)
    return model


def _name_axes(values: list[onnx_ir.Value], specs: list[TensorSpec], graph: str) -> None:
    """Give the graph's I/O the contract's axis names (the exporter names them after its own symbols)."""
    if [value.name for value in values] != [spec.name for spec in specs]:
        raise RuntimeError(f"Graph {graph!r} has I/O {[v.name for v in values]}, expected {[s.name for s in specs]}.")
    for value, spec in zip(values, specs):
        exported = list(value.shape.dims)
        for axis, (have, want) in enumerate(zip(exported, spec.shape)):
            if isinstance(want, str) and isinstance(have, int):
                raise RuntimeError(
                    f"Graph {graph!r}: axis {axis} ({want}) of {spec.name} was specialized to {have} while tracing; "
                    f"the model takes a branch on that size."
                )
            if isinstance(want, int) and have != want:
                raise RuntimeError(f"Graph {graph!r}: {spec.name} has shape {exported}, expected {list(spec.shape)}.")
        value.shape = onnx_ir.Shape(list(spec.shape))


def trace_graphs(
    model: PreTrainedModel,
    task: str,
    specs: list[GraphSpec],
    dtype: torch.dtype,
    device: str,
    opset: int | None,
    stamp_layers: bool,
    say: Callable[[str], None],
    decisions: list[Decision],
) -> dict[str, onnx_ir.Model]:
    """Each spec's graph as it ships: stamped from a two-layer trace where the model is deeper and stamping is safe
    (`stamping.py`), else traced whole (`export_graph`); a stamping refused or failed is logged and added to
    `decisions`."""
    depths = stamping_depths(model) if stamp_layers else {}
    if depths:
        layers = " and ".join(str(depth) for depth in depths.values())
        say(
            f"Exporting graphs {[spec.name for spec in specs]}: torch.onnx.export(dynamo=True) of {TEMPLATE_LAYERS} "
            f"layers, stamped to {layers}"
        )
        try:
            graphs = stamped_graphs(
                model,
                specs,
                lambda: build_graph_specs(model, task, dtype),
                lambda spec: trace_graph(spec, model.config, device, opset),
            )
            return {spec.name: finish_graph(graphs[spec.name], spec) for spec in specs}
        except StampingRefused as refusal:
            say(f"Stamping refused ({refusal}); tracing every layer instead")
            decide(decisions, Decision("tracing", "every layer traced", "stamping", str(refusal)), logging.INFO)
        except Exception as error:  # noqa: BLE001  a stamper defect must not cost the export: trace it whole
            say(f"Stamping failed ({type(error).__name__}: {error}); tracing every layer instead")
            why = f"stamping failed: {type(error).__name__}: {error}"
            decide(decisions, Decision("tracing", "every layer traced", "stamping", why), logging.WARNING)
    graphs = {}
    for spec in specs:
        say(f"Exporting graph {spec.name!r} with torch.onnx.export(dynamo=True)")
        graphs[spec.name] = export_graph(spec, model.config, device, opset)
    return graphs


def decide(decisions: list[Decision], decision: Decision, level: int) -> None:
    """Log `decision` (`level`: WARNING for a fallback after a failure, INFO for an ordinary choice) and keep it for
    the manifest."""
    logger.log(level, "%s: %s instead of %s (%s)", decision.subject, decision.chosen, decision.instead_of, decision.why)
    decisions.append(decision)
