"""A saved graph's weights, read and written one tensor at a time, for rewrites of large graphs (quantization).

Why: a weight loaded into an `onnx.ModelProto` stays in the process until the whole model is freed, even after it is
removed or replaced (protobuf keeps every message's bytes in one arena per model). Quantizing a 1B model's graph
loaded whole held its 4.9 GB of float32 weights, the transposed copy of its head and the quantized weights at once:
2.3x the float weights at the peak. Here the graph is loaded without its weights, each weight is read from the
weights file when it is needed and dropped after, and `save` streams the weights the rewritten graph still reads
into a new weights file:

    >>> model = onnx.load(str(path), load_external_data=False)
    >>> weights = GraphWeights(model, path.parent)
    >>> head = weights.array("lm_head.weight")  # a fresh float32 array, read from model.onnx.data
    >>> ...  # replace nodes, add the quantized tensors to model.graph.initializer
    >>> weights.save(model, path)  # model.onnx and model.onnx.data, the old weights file replaced
"""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ..runtime.contract import EXTERNAL_DATA_THRESHOLD

# Tensors over this many bytes start at a multiple of ALIGNMENT in the weights file, as onnx.save places them, so
# that a runtime may map them in place.
ALIGNED_ABOVE = 1 << 20
ALIGNMENT = 4096


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie in a weights file."""

    file: Path
    offset: int
    length: int
    dtype: np.dtype
    shape: tuple[int, ...]


class GraphWeights:
    """The initializers of `model` (loaded with `load_external_data=False` from a file in `folder`), read on demand.

    Tensors whose data the graph holds itself (small ones, or ones added since) are read from the graph; tensors in
    the weights file from that file, into a new array each time; tensors registered with `transposed` are computed
    from their source when read.
    """

    def __init__(self, model: onnx.ModelProto, folder: Path):
        self.folder = Path(folder)
        self._stored: dict[str, _Stored] = {}
        self._transposed: dict[str, tuple[str, list[int]]] = {}
        root = self.folder.resolve()
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            entries = {entry.key: entry.value for entry in tensor.external_data}
            file = (self.folder / entries["location"]).resolve()
            if root not in file.parents:
                raise ValueError(
                    f"Weight {tensor.name!r} lies outside the graph's folder ({entries['location']}); a graph's "
                    f"weights file must sit beside it."
                )
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            shape = tuple(tensor.dims)
            length = int(entries.get("length", int(np.prod(shape)) * dtype.itemsize))
            self._stored[tensor.name] = _Stored(file, int(entries.get("offset", 0)), length, dtype, shape)
        self._graph = model.graph

    def array(self, name: str) -> np.ndarray:
        """The initializer `name` as a new array (its bytes are read from disk, not kept)."""
        if name in self._transposed:
            source, permutation = self._transposed[name]
            return np.ascontiguousarray(np.transpose(self.array(source), permutation))
        stored = self._stored.get(name)
        if stored is None:
            tensor = next((tensor for tensor in self._graph.initializer if tensor.name == name), None)
            if tensor is None:
                raise KeyError(f"The graph has no initializer {name!r}.")
            return onnx.numpy_helper.to_array(tensor)
        data = np.fromfile(stored.file, dtype=np.uint8, count=stored.length, offset=stored.offset)
        if data.size != stored.length:
            raise ValueError(f"{stored.file} ends before weight {name!r} does: the weights file is truncated.")
        return data.view(stored.dtype).reshape(stored.shape)

    def transposed(self, source: str, name: str, permutation: list[int] | None) -> onnx.TensorProto:
        """An initializer `name` that reads as `source` transposed by `permutation` (reversed axes for None), for
        the caller to add to the graph: it holds no data, which is computed when read (or saved)."""
        stub = next(tensor for tensor in self._graph.initializer if tensor.name == source)
        axes = permutation if permutation is not None else list(reversed(range(len(stub.dims))))
        self._transposed[name] = (source, axes)
        return _shape_only(name, stub.data_type, [stub.dims[axis] for axis in axes])

    def save(self, model: onnx.ModelProto, path: Path) -> None:
        """Write `model` to `path` and every initializer over `EXTERNAL_DATA_THRESHOLD` bytes to `<path>.data`,
        one tensor at a time, dropping initializers no node reads. The weights file it was read from may be `path`'s
        own: the new one is written beside it and replaces it at the end."""
        path = Path(path)
        graph = model.graph
        read = _read_names(graph)
        for tensor in [tensor for tensor in graph.initializer if tensor.name not in read]:
            graph.initializer.remove(tensor)
        location = f"{path.name}.data"
        partial = path.with_name(f"{location}.partial")
        offset = 0
        with open(partial, "wb") as out:
            for tensor in graph.initializer:
                if tensor.name in self._stored or tensor.name in self._transposed:
                    data = self.array(tensor.name).tobytes()
                elif tensor.HasField("raw_data") and len(tensor.raw_data) > EXTERNAL_DATA_THRESHOLD:
                    data = tensor.raw_data
                else:
                    continue  # small: it stays in the graph
                if len(data) > ALIGNED_ABOVE and offset % ALIGNMENT:
                    out.write(b"\0" * (ALIGNMENT - offset % ALIGNMENT))
                    offset += ALIGNMENT - offset % ALIGNMENT
                out.write(data)
                tensor.ClearField("raw_data")
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", location), ("offset", offset), ("length", len(data))):
                    tensor.external_data.add(key=key, value=str(value))
                offset += len(data)
                del data
        os.replace(partial, path.with_name(location))
        onnx.save_model(model, str(path))


def _shape_only(name: str, data_type: int, dims: list[int]) -> onnx.TensorProto:
    """A tensor with a name, type and shape and no data (what `GraphWeights.transposed` hands the graph)."""
    tensor = onnx.TensorProto(name=name, data_type=data_type)
    tensor.dims.extend(dims)
    return tensor


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    names = {output.name for output in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                names |= _read_names(subgraph)
    return names
