"""Layer stamping: build a deep model's graph from a traced two-layer copy, in a time that hardly grows with depth.

`torch.onnx.export(dynamo=True)` traces, decomposes and optimizes every block, so exporting grows with depth (about a
second per layer for a SmolLM2-sized block on a 2-core CPU). The blocks of a stack are the same computation with other
weights, so `stamped_graphs` traces a copy of the model whose every stack is cut to its first two blocks, and in each
traced graph clones the second block's nodes once per further layer:

- each clone reads the previous clone's hidden state (the second block reads the first block's, which identifies the
  block's input and output in the graph), its own cache tensors (`past_key_values.{i}.*` in, `present.{i}.*` out,
  `cross_key_values.{i}.*`) and its own weights;
- everything computed outside the blocks (embeddings, rotary cos/sin, the mask, position biases, the final norm and
  head) is traced once and shared, as the full trace shares it;
- the weights are found by value: the two traced blocks carry random "fingerprint" weights, so each initializer the
  exporter wrote for them (a weight as it is, or transposed for a MatMul) names the parameter it came from, and is
  replaced by the real layer's tensor in the same form.

The result is the graph a full trace gives (the same nodes per layer, the same inputs and outputs in the contract's
order), and the export validates it against the full PyTorch model as always. Anything the stamper does not recognize
(a node of a block that reads another block's values, a weight the exporter transformed, a block whose work leaks
outside its scope) raises `StampingRefused`, and the caller traces the whole model instead.

Example (what `export_onnx` does; `trace_graph` keeps the exporter's node metadata, which stamping reads):
    >>> specs = build_graph_specs(model, "text-generation", torch.float32)
    >>> graphs = stamped_graphs(
    ...     model, specs, lambda: build_graph_specs(model, "text-generation", torch.float32),
    ...     lambda spec: trace_graph(spec, model.config, "cpu", 23),
    ... )  # {graph name: onnx_ir.Model}; raises StampingRefused when unsafe
"""

import ast
import copy
import hashlib
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnx_ir
import torch
from torch import nn
from transformers import PreTrainedModel

from ..modeling.pretrained import VaswaniStack
from ..runtime.contract import GraphSpec
from .formulations import module_configs

# Blocks traced per stack: two, so that the second block's input is the first block's output.
TEMPLATE_LAYERS = 2

# Graph inputs and outputs that belong to one layer: `past_key_values.3.key`, `present.3.value`, `cross_key_values.3.key`.
_LAYER_IO = re.compile(r"^(?P<prefix>\w+)\.(?P<layer>\d+)\.(?P<kind>key|value)$")

# Ops that read only the shape of their input: a layer's cache input read by one (the mask's length) is not data.
_SHAPE_READERS = {"Shape", "Size"}


class StampingRefused(RuntimeError):
    """The traced blocks cannot be stamped safely; the message says why (the export then traces every layer)."""


def stamping_depths(model: PreTrainedModel) -> dict[str, int]:
    """The depth of each stack stamping would shorten: {stack path: layers}; empty if no stack is deeper than the
    template (then a full trace costs the same)."""
    return {
        name: len(module.layers)
        for name, module in model.named_modules()
        if isinstance(module, VaswaniStack) and len(module.layers) > TEMPLATE_LAYERS
    }


def stamped_graphs(
    model: PreTrainedModel,
    specs: list[GraphSpec],
    build_specs: Callable[[], list[GraphSpec]],
    trace: Callable[[GraphSpec], onnx_ir.Model],
) -> dict[str, onnx_ir.Model]:
    """Every graph of `specs` (the real model's), built from a trace of `model` cut to `TEMPLATE_LAYERS` blocks per
    stack and stamped back to full depth; raises `StampingRefused` when a graph cannot be stamped safely.

    `build_specs()` builds the graph specs of `model` as it is when called (the cut copy, during tracing); `trace(spec)`
    traces one spec with the exporter's node metadata (module scopes) intact.
    """
    real_lists = {spec.name: _module_lists(spec.module) for spec in specs}
    with _cut_to_template(model) as fingerprints:
        templates = {spec.name: spec for spec in build_specs()}
        # The wrappers hold the model itself: their lists are read while it is cut.
        template_lists = {name: _module_lists(spec.module) for name, spec in templates.items()}
        traced = {name: trace(spec) for name, spec in templates.items()}
    graphs = {}
    for spec in specs:
        if spec.name not in traced:
            raise StampingRefused(f"the cut model has no graph {spec.name!r}")
        graph = traced[spec.name].graph
        for path, template_units in template_lists[spec.name].items():
            real_units = real_lists[spec.name].get(path, [])
            if len(template_units) == TEMPLATE_LAYERS and len(real_units) > TEMPLATE_LAYERS:
                _check_alike(path, real_units)
                _Stamper(graph, path, template_units, real_units, fingerprints).stamp()
        _order_io(graph, spec)
        graph.sort()
        graphs[spec.name] = traced[spec.name]
    return graphs


@contextmanager
def _cut_to_template(model: PreTrainedModel) -> Iterator[dict[int, torch.Tensor]]:
    """Cut every deep stack of `model` to copies of its first blocks, with random weights, and its configs' depths to
    match, until the block exits. Yields {id(copied parameter): its fingerprint}."""
    stacks = [module for module in model.modules() if isinstance(module, VaswaniStack)]
    stacks = [stack for stack in stacks if len(stack.layers) > TEMPLATE_LAYERS]
    configs = module_configs(model)
    # Copies of blocks keep pointing at the model's configs (the exporter switches their attention backend).
    memo = {key: config for key, config in configs.items()}
    saved_layers = [(stack, stack.layers) for stack in stacks]
    saved_depths = [
        (config, name, getattr(config, name))
        for config in configs.values()
        for name in ("num_hidden_layers", "encoder_layers", "decoder_layers")
        if isinstance(getattr(config, name, None), int)
    ]
    generator = torch.Generator().manual_seed(0)
    fingerprints = {}
    try:
        for stack in stacks:
            blocks = nn.ModuleList(copy.deepcopy(block, memo) for block in stack.layers[:TEMPLATE_LAYERS])
            for parameter in blocks.parameters():
                fingerprint = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
                parameter.data = fingerprint.to(parameter.device)
                fingerprints[id(parameter)] = parameter.data
            stack.layers = blocks
        _set_depths(model, stacks)
        yield fingerprints
    finally:
        for stack, layers in saved_layers:
            stack.layers = layers
        for config, name, depth in saved_depths:
            setattr(config, name, depth)


def _set_depths(model: PreTrainedModel, stacks: list[VaswaniStack]) -> None:
    """Make the configs say the depth the cut stacks have: each stack's own `num_hidden_layers`, and an
    encoder-decoder config's `encoder_layers`, `decoder_layers` and `num_hidden_layers` (the decoder's, which sizes
    caches); the graph specs size the cache inputs from them."""
    for stack in stacks:
        stack.config.num_hidden_layers = len(stack.layers)
    if getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        model.config.encoder_layers = len(model.get_encoder().layers)
        model.config.num_hidden_layers = model.config.decoder_layers = len(model.get_decoder().layers)


def _module_lists(wrapper: nn.Module) -> dict[str, list[nn.Module]]:
    """{path: modules} of every module list in a graph's wrapper: the blocks of each stack, and per-layer lists built
    from them (the encoder graph's cross-attentions)."""
    return {path: list(module) for path, module in wrapper.named_modules() if isinstance(module, nn.ModuleList)}


# Per-layer attributes that do not change what a layer computes.
_LAYER_NUMBERING = {"layer_idx"}


def _structure(unit: nn.Module) -> list:
    """What a layer computes, as far as the module tree tells: each submodule's class and settings (`repr`, plain
    attributes, names of other attributes such as a patched `forward`) and its parameters' shapes and dtypes."""
    described = []
    for name, module in unit.named_modules():
        attributes = {
            key: value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__
            for key, value in vars(module).items()
            if not key.startswith("_") and key not in _LAYER_NUMBERING and key != "training"
        }
        parameters = [(key, tuple(p.shape), p.dtype) for key, p in module.named_parameters(recurse=False)]
        described.append((name, type(module).__qualname__, module.extra_repr(), sorted(attributes.items()), parameters))
    return described


def _check_alike(path: str, units: list[nn.Module]) -> None:
    """Refuse to stamp layers that differ from the traced second one (a layer-specific activation, a patched
    forward, another width): each clone is a copy of the second layer's nodes."""
    template = _structure(units[1])
    for layer in range(TEMPLATE_LAYERS, len(units)):
        if _structure(units[layer]) != template:
            raise StampingRefused(f"{path}.{layer} is built differently from {path}.1")


@dataclass(frozen=True)
class _Weight:
    """Where an initializer of a template block comes from: that block's parameter, as is or transposed."""

    unit: int
    parameter: str
    transposed: bool


def _digest(array: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).digest()


def _scopes(node: onnx_ir.Node) -> set[str]:
    """The module paths a node was traced in (the exporter's `name_scopes` metadata)."""
    text = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    try:
        return set(ast.literal_eval(text)) if text else set()
    except (ValueError, SyntaxError):
        return set()


class _Stamper:
    """Stamps one stack of one traced graph from `TEMPLATE_LAYERS` traced units to `len(real_units)`."""

    def __init__(
        self,
        graph: onnx_ir.Graph,
        path: str,
        template_units: list[nn.Module],
        real_units: list[nn.Module],
        fingerprints: dict[int, torch.Tensor],
    ) -> None:
        self.graph, self.path, self.real_units = graph, path, real_units
        self.units = self._find_units()
        self.weights = self._find_weights(template_units, fingerprints)
        self.layer_inputs = [self._find_layer_inputs(unit) for unit in range(TEMPLATE_LAYERS)]

    def _find_units(self) -> list[list[onnx_ir.Node]]:
        """Each template unit's nodes, in graph order: those traced in its scope, and those the exporter's optimizer
        created without any scope (a Split replacing two Slices) that only that unit's nodes read."""
        unit_of: dict[onnx_ir.Node, int] = {}
        unscoped = []
        for node in self.graph:
            scopes = _scopes(node)
            if not scopes:
                unscoped.append(node)
            for unit in range(TEMPLATE_LAYERS):
                if f"{self.path}.{unit}" in scopes:
                    unit_of[node] = unit
        for node in reversed(unscoped):  # readers first, so a chain of unscoped nodes is adopted whole
            readers = {unit_of.get(use.node) for output in node.outputs for use in output.uses()}
            if (
                len(readers) == 1
                and None not in readers
                and not any(output.is_graph_output() for output in node.outputs)
            ):
                unit_of[node] = readers.pop()
        return [[node for node in self.graph if unit_of.get(node) == unit] for unit in range(TEMPLATE_LAYERS)]

    def _find_weights(self, template_units: list[nn.Module], fingerprints: dict[int, torch.Tensor]) -> dict:
        """{initializer: _Weight} for every initializer holding a template unit's fingerprint, as is or transposed."""
        digests = {}
        for unit, module in enumerate(template_units):
            for name, parameter in module.named_parameters():
                array = fingerprints[id(parameter)].detach().cpu().numpy()
                digests[(array.shape, array.dtype, _digest(array))] = _Weight(unit, name, False)
                if array.ndim == 2:
                    digests[(array.T.shape, array.dtype, _digest(array.T))] = _Weight(unit, name, True)
        shapes = {(shape, dtype) for shape, dtype, _ in digests}
        weights = {}
        for value in self.graph.initializers.values():
            if value.const_value is None:
                continue
            array = value.const_value.numpy()
            if (array.shape, array.dtype) in shapes:
                found = digests.get((array.shape, array.dtype, _digest(array)))
                if found is not None:
                    weights[value] = found
        # A weight the exporter transformed otherwise is no fingerprint: the second unit's copy of it then fails the
        # check for constants of its own (`_analyse`). Weights the graph does not use (the encoder graph reads only
        # the cross-attention's key/value projections) are absent from both units.
        found = [{(w.parameter, w.transposed) for w in weights.values() if w.unit == unit} for unit in range(2)]
        if found[0] != found[1]:
            raise StampingRefused(f"{self.path}.0 and {self.path}.1 use different weights: {found[0] ^ found[1]}")
        if len(set(weights.values())) != len(weights):
            raise StampingRefused(f"a weight of {self.path} is held by two initializers")
        return weights

    # ------------------------------------------------------------------------------------------------- analysis

    def _find_layer_inputs(self, unit: int) -> set[onnx_ir.Value]:
        """The graph inputs named for layer `unit` (cache tensors) that the unit's nodes read."""
        nodes = set(self.units[unit])
        return {
            value
            for value in self.graph.inputs
            if (match := _LAYER_IO.match(value.name or "")) is not None
            and int(match["layer"]) == unit
            and any(use.node in nodes for use in value.uses())
        }

    def _taint(self) -> dict[onnx_ir.Value, frozenset[int]]:
        """For each value, the template units whose weights or cache inputs it depends on (through data, not shapes)."""
        taint: dict[onnx_ir.Value, frozenset[int]] = {}
        for value, weight in self.weights.items():
            taint[value] = frozenset({weight.unit})
        for unit in range(TEMPLATE_LAYERS):
            for value in self.layer_inputs[unit]:
                taint[value] = frozenset({unit})
        for node in self.graph:
            if node.op_type in _SHAPE_READERS:
                continue
            sources = frozenset().union(*(taint.get(value, frozenset()) for value in node.inputs if value is not None))
            if sources:
                for output in node.outputs:
                    taint[output] = sources
        return taint

    def _analyse(self) -> tuple[onnx_ir.Value | None, onnx_ir.Value | None]:
        """Check that the second unit is a clonable copy of the first and find the hidden state that links them:
        (the first unit's output read by the second, the second unit's output read after the stack), or
        (None, None) for units side by side (the encoder graph's cross-attention projections)."""
        first, second = (set(nodes) for nodes in self.units)
        if first & second:
            raise StampingRefused(f"nodes in both {self.path}.0 and {self.path}.1")
        for node in self.units[1]:
            for attribute in node.attributes.values():
                if attribute.type in (onnx_ir.AttributeType.GRAPH, onnx_ir.AttributeType.GRAPHS):
                    raise StampingRefused(f"{node.op_type} node with a subgraph in {self.path}.1")
        taint = self._taint()
        produced = {output for node in self.units[1] for output in node.outputs}
        weights_1 = {value for value, weight in self.weights.items() if weight.unit == 1}
        links = set()
        for node in self.units[1]:
            for value in node.inputs:
                if value is None or value in produced or value in weights_1:
                    continue
                sources = taint.get(value, frozenset())
                if value in self.layer_inputs[1]:
                    continue
                if sources == frozenset({0}) and value.producer() in first:
                    links.add(value)
                elif sources:
                    raise StampingRefused(f"{self.path}.1 reads {value.name!r}, computed from {sorted(sources)}")
                elif value.is_initializer() and not self._shared(value) and _is_float_array(value):
                    raise StampingRefused(f"{self.path}.1 holds constant {value.name!r} that is no weight of its own")
        if len(links) > 1:
            raise StampingRefused(f"{self.path}.1 reads {len(links)} values of {self.path}.0: {_names(links)}")
        exits = set()
        for value in produced:
            readers = {use.node for use in value.uses()} - second
            if value.is_graph_output():
                match = _LAYER_IO.match(value.name or "")
                if match is None:
                    exits.add(value)  # a stack output that is also a graph output (last_hidden_state)
                elif int(match["layer"]) != 1:
                    raise StampingRefused(f"{self.path}.1 writes {value.name!r}")
            if readers:
                exits.add(value)
        if len(exits) != len(links):
            raise StampingRefused(
                f"{self.path}.1 hands on {_names(exits)} but reads {_names(links)} from {self.path}.0"
            )
        link, exit_ = (next(iter(links)), next(iter(exits))) if links else (None, None)
        if link is not None and {use.node for use in link.uses()} - second:
            raise StampingRefused(f"{link.name!r}, the output of {self.path}.0, is read outside {self.path}.1")
        self._check_outside(taint, exit_)
        return link, exit_

    def _check_outside(self, taint: dict, exit_: onnx_ir.Value | None) -> None:
        """Nodes outside both units may read the units' work only through the stack's output (the final norm, the
        head): anything else (a skip connection, a node fused across the unit boundary) would not be stamped."""
        units = set(self.units[0]) | set(self.units[1])
        after = {exit_} if exit_ is not None else set()
        for node in self.graph:
            if node in units or node.op_type in _SHAPE_READERS:
                continue
            tainted = [value for value in node.inputs if value is not None and taint.get(value)]
            if not tainted:
                continue
            if all(value in after for value in tainted):
                after.update(node.outputs)
            else:
                raise StampingRefused(f"{node.op_type} node {node.name!r} outside {self.path} reads its layers' values")

    def _shared(self, value: onnx_ir.Value) -> bool:
        second = set(self.units[1])
        return any(use.node not in second for use in value.uses())

    # ------------------------------------------------------------------------------------------------ stamping

    def stamp(self) -> None:
        if not any(self.units):
            return  # this graph does not run the stack (the decoder graph holds the encoder's blocks, unused)
        if not all(self.units):
            raise StampingRefused(f"no nodes traced in the scope of {self.path}.0 or {self.path}.1")
        link, exit_ = self._analyse()
        depth = len(self.real_units)
        layer_inputs = self.layer_inputs[1]
        for value, weight in self.weights.items():
            value.const_value = self._real_weight(weight.unit, weight)
            value.name = _weight_name(self.path, weight.unit, weight)
        last, previous_exit = self.units[1][-1], exit_
        readers = [(use.node, use.idx) for use in exit_.uses() if use.node not in set(self.units[1])] if exit_ else []
        was_output = exit_ is not None and exit_.is_graph_output()
        for layer in range(TEMPLATE_LAYERS, depth):
            values: dict[onnx_ir.Value, onnx_ir.Value] = {}
            if link is not None:
                values[link] = previous_exit
            clones = []
            for node in self.units[1]:
                inputs = [self._input(value, layer, values, layer_inputs) for value in node.inputs]
                clone = onnx_ir.Node(
                    node.domain,
                    node.op_type,
                    inputs,
                    list(node.attributes.values()),
                    overload=node.overload,
                    num_outputs=len(node.outputs),
                    version=node.version,
                    name=f"{node.name}.layer{layer}" if node.name else None,
                )
                for old, new in zip(node.outputs, clone.outputs):
                    new.name, new.shape, new.type = _layer_name(old.name, layer), old.shape, old.type
                    values[old] = new
                    if old.is_graph_output():
                        if old is exit_:
                            continue
                        self.graph.outputs.append(new)
                clones.append(clone)
            self.graph.insert_after(last, clones)
            last = clones[-1]
            if exit_ is not None:
                previous_exit = values[exit_]
        if exit_ is not None and previous_exit is not exit_:
            for node, index in readers:
                node.replace_input_with(index, previous_exit)
            if was_output:
                position = list(self.graph.outputs).index(exit_)
                name = exit_.name
                exit_.name = f"{name}.layer1"
                previous_exit.name = name
                self.graph.outputs[position] = previous_exit

    def _input(
        self, value: onnx_ir.Value | None, layer: int, values: dict, layer_inputs: set[onnx_ir.Value]
    ) -> onnx_ir.Value | None:
        if value is None:
            return None
        if value in values:
            return values[value]
        weight = self.weights.get(value)
        if weight is not None:
            values[value] = self._initializer(layer, weight)
        elif value in layer_inputs:
            values[value] = self._graph_input(value, layer)
        else:
            return value  # shared: computed once, outside the blocks (or by the first block, for all)
        return values[value]

    def _real_weight(self, layer: int, weight: _Weight) -> onnx_ir.TensorProtocol:
        parameter = self.real_units[layer].get_parameter(weight.parameter)
        array = parameter.detach().cpu().numpy()
        if not weight.transposed:
            return onnx_ir.Tensor(array)
        # Transposed when written, one weight at a time: the model's weights transposed all at once would double the
        # export's memory (4 GB more for a 1B model).
        return onnx_ir.LazyTensor(
            lambda: onnx_ir.Tensor(np.ascontiguousarray(array.T)),
            dtype=onnx_ir.DataType.from_numpy(array.dtype),
            shape=onnx_ir.Shape(array.T.shape),
        )

    def _initializer(self, layer: int, weight: _Weight) -> onnx_ir.Value:
        tensor = self._real_weight(layer, weight)
        value = onnx_ir.Value(
            name=_weight_name(self.path, layer, weight),
            shape=onnx_ir.Shape(tensor.shape),
            type=onnx_ir.TensorType(tensor.dtype),
            const_value=tensor,
        )
        self.graph.register_initializer(value)
        return value

    def _graph_input(self, template: onnx_ir.Value, layer: int) -> onnx_ir.Value:
        match = _LAYER_IO.match(template.name)
        value = onnx_ir.Value(
            name=f"{match['prefix']}.{layer}.{match['kind']}", shape=template.shape, type=template.type
        )
        self.graph.inputs.append(value)
        return value


def _layer_name(name: str | None, layer: int) -> str | None:
    """A clone's value name: a layer's graph output keeps the contract's form (`present.{layer}.key`)."""
    if name is None:
        return None
    match = _LAYER_IO.match(name)
    if match is not None:
        return f"{match['prefix']}.{layer}.{match['kind']}"
    return f"{name}.layer{layer}"


def _weight_name(path: str, layer: int, weight: _Weight) -> str:
    return f"{path}.{layer}.{weight.parameter}" + (".transposed" if weight.transposed else "")


def _is_float_array(value: onnx_ir.Value) -> bool:
    tensor = value.const_value
    return tensor is not None and tensor.dtype.is_floating_point() and tensor.size > 1


def _names(values: set[onnx_ir.Value]) -> list[str]:
    return sorted(str(value.name) for value in values)


def _order_io(graph: onnx_ir.Graph, spec: GraphSpec) -> None:
    """Put the stamped graph's inputs and outputs in the contract's order; raise if any is missing or extra."""
    for values, specs, kind in ((graph.inputs, spec.inputs, "inputs"), (graph.outputs, spec.outputs, "outputs")):
        by_name = {value.name: value for value in values}
        names = [tensor.name for tensor in specs]
        if sorted(by_name) != sorted(names) or len(by_name) != len(values):
            raise StampingRefused(f"stamped graph {spec.name!r} has {kind} {sorted(by_name)}, expected {names}")
        ordered = [by_name[name] for name in names]
        values.clear()
        values.extend(ordered)
