"""The portable decoder graph, as OpenVINO reads it, turned into the forms its CPU plugin runs fastest: stateful
(`make_stateful`: the cache held in an infer request, what `generate`'s loop runs) and paged (`make_paged`: each
sequence's cache in blocks of shared tensors, what the server's batch runs). Both edit the graph in place, exactly;
`openvino.OpenVinoDecoder` and `decoders/paged.py` compile the results.

    >>> pairs = make_stateful(model, manifest)       # {"past_key_values.0.key": "present.0.key", ...}
    >>> make_paged(other_copy, manifest)             # raises a ValueError naming what it cannot place
"""

from typing import Any

import numpy as np


def make_stateful(model: Any, manifest: dict) -> dict[str, str]:
    """Turn a portable decoder graph, read by OpenVINO, into the stateful form its CPU plugin fuses into one
    attention-with-cache kernel (the form OpenVINO GenAI's models have):
    - each past/present pair becomes one state (OpenVINO's `MakeStateful`), starting empty for the batch of
      `input_ids` on every new infer request;
    - each state is read through a `Gather` by a new `beam_idx` input (the rows to keep, in order), which the fusion
      expects;
    - the grouped-query heads' `Tile` of the keys and values becomes the equal bidirectional `Broadcast` (the repeated
      axis has size 1), the form the fusion recognises.
    Returns the past input -> present output pairs that became states, in the graph's cache order."""
    import openvino
    from openvino import opset13
    from openvino.passes import MakeStateful, Manager

    layers, heads, head_dim = manifest["num_layers"], manifest["num_key_value_heads"], manifest["head_dim"]
    pairs = {f"past_key_values.{i}.{kind}": f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")}
    manager = Manager()
    manager.register_pass(MakeStateful(pairs))
    manager.run_passes(model)
    rows = opset13.parameter([-1], openvino.Type.i32, name="beam_idx")
    rows.output(0).set_names({"beam_idx"})
    input_ids = next(parameter for parameter in model.get_parameters() if parameter.get_friendly_name() == "input_ids")
    axis0 = opset13.constant(np.array(0, dtype=np.int64))
    batch = opset13.gather(opset13.shape_of(input_ids), opset13.constant(np.array([0], dtype=np.int64)), axis0)
    empty_shape = opset13.concat([batch, opset13.constant(np.array([heads, 0, head_dim], dtype=np.int64))], 0)
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "ReadValue":
            node.set_arguments([opset13.broadcast(opset13.constant(np.array(0, dtype=np.float32)), empty_shape)])
            readers = list(node.output(0).get_target_inputs())
            kept = opset13.gather(node.output(0), rows, axis0)
            for reader in readers:
                reader.replace_source_output(kept.output(0))
        elif kind == "Tile" and repeats_unit_axes(node):
            broadcast = opset13.broadcast(node.input_value(0), node.input_value(1), broadcast_spec="BIDIRECTIONAL")
            broadcast.set_friendly_name(node.get_friendly_name())
            node.output(0).replace(broadcast.output(0))
    model.add_parameters([rows])
    model.validate_nodes_and_infer_types()
    return pairs


def make_paged(model: Any, manifest: dict) -> None:
    """Turn a portable decoder graph, read by OpenVINO, into the paged form OpenVINO GenAI's continuous batching runs
    (its `PagedAttentionExtension`, through OpenVINO's own `paged_attention_transformation`): the tokens of every
    sequence of a call flattened into one row, each sequence's cache in fixed-size blocks of shared cache tensors
    listed per sequence (`key_cache.{i}`, `value_cache.{i}`, `block_indices`, `past_lens`, `subsequence_begins`, ...),
    so that sequences of any lengths decode and prefill side by side without padding or copies (`decoders/paged.py`).

    Two edits make the exporter's graph fit it, both exact:
    - the rotary tables read the batch size from `attention_mask`'s shape, which the paged form drops: they read it
      from `input_ids`'s, equal in every call of the graph;
    - `logits_positions` picks positions along the sequence axis, which becomes length 1: it picks flat tokens.
    Raises a ValueError naming what it cannot place (a graph another exporter wrote, or one without `position_ids`:
    ALiBi)."""
    from openvino import opset13
    from openvino._offline_transformations import paged_attention_transformation

    parameters = {parameter.get_friendly_name(): parameter for parameter in model.get_parameters()}
    if "position_ids" not in parameters:
        raise ValueError("the graph takes no position_ids (ALiBi positions), which the paged form needs")
    make_stateful(model, manifest)
    mask, input_ids = parameters["attention_mask"], parameters["input_ids"]
    for node in model.get_ordered_ops():
        if node.get_type_name() == "ShapeOf" and node.input_value(0).get_node() is mask:
            if not all(takes_first_element(reader.get_node()) for reader in node.output(0).get_target_inputs()):
                raise ValueError("the graph reads attention_mask's length, which the paged form does not have")
            node.input(0).replace_source_output(input_ids.output(0))
    paged_attention_transformation(model)
    gathers = [
        reader.get_node()
        for reshape in parameters["logits_positions"].output(0).get_target_inputs()
        for reader in reshape.get_node().output(0).get_target_inputs()
    ]
    if len(gathers) != 1 or gathers[0].get_type_name() != "Gather":
        raise ValueError("the graph's logits_positions is not one Gather of the hidden states")
    gathers[0].input(2).replace_source_output(opset13.constant(np.array(0, dtype=np.int64)).output(0))
    model.validate_nodes_and_infer_types()


def takes_first_element(node: Any) -> bool:
    """Whether `node` is a Slice of a shape's first element only (the batch size)."""
    if node.get_type_name() != "Slice":
        return False
    bounds = [node.input_value(index).get_node() for index in range(1, node.get_input_size())]
    if not all(bound.get_type_name() == "Constant" for bound in bounds):
        return False
    start, stop, step, *axes = (list(bound.get_vector()) for bound in bounds)
    return start == [0] and stop == [1] and step == [1] and axes in ([], [[0]])


def repeats_unit_axes(tile: Any) -> bool:
    """Whether a `Tile` only repeats axes of size 1 (so a bidirectional `Broadcast` computes the same)."""
    repeats = tile.input_value(1).get_node()
    shape = tile.input_value(0).get_partial_shape()
    if repeats.get_type_name() != "Constant" or shape.rank.is_dynamic:
        return False
    counts = repeats.get_vector()
    return len(counts) == shape.rank.get_length() and all(
        count == 1 or (dim.is_static and dim.get_length() == 1) for count, dim in zip(counts, shape)
    )
