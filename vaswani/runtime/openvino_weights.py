"""Quantized weights that OpenVINO reads from the export's own data file instead of a copy in memory.

OpenVINO's ONNX reader maps an export's external data (`model.onnx.data`) and reads float initializers in place, but
turning ONNX Runtime's `MatMulNBits` into its own compressed-weight pattern builds each 8-bit or 4-bit weight as a
new constant from a copy of its bytes: 1.2 GB of process memory for a 1B int8 export, held for as long as any graph
or compiled model made from the read graph lives (the CPU plugin keeps the constants it was compiled from).
OpenVINO GenAI's models do not pay it: their IR file is mapped.

`map_file_weights` puts those bytes back where they came from. Each such constant is replaced by one of the same
type and shape over the file's own pages (a copy-on-write mapping that nothing writes), once its bytes have been
compared with the file's and found equal: so the graph computes exactly what it computed, and its weights become
page cache (shared, reclaimable, read from disk once) rather than anonymous memory. OpenVINO does not keep the
mapping alive on its own: the `FileWeights` returned holds it, and every object holding a graph or compiled model
made from the read graph must hold it too.

    >>> core, graph, weights = read_graph(Path("onnx-folder/model_portable.onnx"))  # calls map_file_weights
    >>> weights.constants, weights.bytes       # the constants now read from the file, and their bytes
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PREFIX_BYTES = 4096


@dataclass
class FileWeights:
    """The data files a graph's quantized weights now read from, mapped (keep it as long as the graph and anything
    compiled from it), and how many constants and bytes read from them."""

    maps: dict[Path, np.memmap] = field(default_factory=dict)
    constants: int = 0
    bytes: int = 0

    def view(self, file: Path, offset: int, length: int) -> np.ndarray:
        """`length` bytes of `file` from `offset`, as a view of its mapping."""
        if file not in self.maps:
            # "c" (copy-on-write): OpenVINO takes only writable arrays, and nothing writes, so every page stays the
            # file's.
            self.maps[file] = np.memmap(file, dtype=np.uint8, mode="c")
        return self.maps[file][offset : offset + length]


def external_spans(path: Path) -> dict[int, list[tuple[Path, int]]]:
    """The graph's initializers stored in external data, by byte length: (file, offset) of each."""
    import onnx

    spans: dict[int, list[tuple[Path, int]]] = {}
    for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if "length" in entries:
            spans.setdefault(int(entries["length"]), []).append(
                (path.parent / entries["location"], int(entries.get("offset", 0)))
            )
    return spans


def map_file_weights(graph: Any, path: Path) -> FileWeights:
    """Replace each 8-bit or 4-bit constant of `graph` (as OpenVINO read it from `path`) whose bytes are those of an
    initializer in the graph's external data by the same constant over the file's mapped pages. Returns what holds
    the mapping: keep it with the graph."""
    import openvino

    weights = FileWeights()
    spans = external_spans(path)
    packed = (openvino.Type.u8, openvino.Type.i8, openvino.Type.u4, openvino.Type.i4)
    for constant in graph.get_ops():
        if constant.get_type_name() != "Constant" or constant.get_element_type() not in packed:
            continue
        size = constant.get_byte_size()
        if size not in spans:
            continue
        own = np.asarray(constant.data).view(np.uint8).reshape(-1)
        for file, offset in spans[size]:
            mapped = weights.view(file, offset, size)
            # Layers' weights share sizes: their first bytes tell them apart before the whole comparison.
            if not np.array_equal(own[:PREFIX_BYTES], mapped[:PREFIX_BYTES]) or not np.array_equal(own, mapped):
                continue
            shape = openvino.Shape(list(constant.get_output_shape(0)))
            tensor = openvino.Tensor(mapped, shape, constant.get_element_type())  # shares `mapped`
            replacement = openvino.op.Constant(tensor, shared_memory=True)
            replacement.set_friendly_name(constant.get_friendly_name())
            constant.output(0).replace(replacement.output(0))
            weights.constants += 1
            weights.bytes += size
            break
    if weights.constants:
        logger.info(
            "OpenVINO reads %d quantized weights (%.0f MB) from %s in place, not from a copy in memory",
            weights.constants,
            weights.bytes / 1e6,
            ", ".join(sorted(file.name for file in weights.maps)),
        )
    return weights
