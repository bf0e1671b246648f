"""The portable decoder graph a GroupQueryAttention-form export carries beside it (`portable_form` in the manifest,
`runtime.contract.portable_view`), so that an engine without GroupQueryAttention (OpenVINO) runs the default export
too, where it was measured faster (docs/deployment.md).

The graph is the decoder as it was just before the rewrite into GroupQueryAttention (`forms.derive_form`): quantized
already, so its weight matrices are the very bytes the GroupQueryAttention graph reads. It is saved as
`model_portable.onnx` pointing at those bytes in `model.onnx.data`; only the tensors the rewrite changed or dropped
(its position tables, say) go to `model_portable.onnx.data`. The folder grows by the graph file and those, not by a
second copy of the weights.

    >>> kept = keep_portable_graph(staging / "model.onnx")        # before the rewrite
    >>> rewrite_decoder_attention(staging / "model.onnx", ...)
    >>> entry = write_portable_graph(kept, staging / "model.onnx")  # the manifest's portable_form["graphs"]["model"]
"""

import hashlib
import mmap
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from ..runtime.contract import graph_io

# The portable graph of a decoder graph `model.onnx`: `model_portable.onnx` (with `model_portable.onnx.data`).
PORTABLE_SUFFIX = "_portable"


@dataclass(frozen=True)
class KeptGraph:
    """A graph file kept as it was (`keep_portable_graph`): the graph, and a copy of the weights it points at."""

    graph: Path  # model_portable.onnx: its tensors still name model.onnx.data's offsets, as they were
    data: Path  # a copy of model.onnx.data as it was; removed by `write_portable_graph`
    location: str  # the weights file the tensors name: "model.onnx.data"


def portable_graph_path(graph: Path) -> Path:
    return graph.with_name(f"{graph.stem}{PORTABLE_SUFFIX}{graph.suffix}")


def keep_portable_graph(graph: Path) -> KeptGraph:
    """Copy `graph` and its weights file aside, before a rewrite saves over both."""
    kept = KeptGraph(portable_graph_path(graph), graph.with_name(f".{graph.name}.kept.data"), f"{graph.name}.data")
    shutil.copyfile(graph, kept.graph)
    shutil.copyfile(graph.with_name(kept.location), kept.data)
    return kept


def write_portable_graph(kept: KeptGraph, shared_graph: Path) -> dict:
    """Point each weight of the kept graph at the identical bytes (compared byte for byte) of `shared_graph`'s
    weights file; the tensors found nowhere there go to the kept graph's own weights file. Returns the graph's
    manifest entry (`contract.graph_io`)."""
    shared_data = shared_graph.with_name(f"{shared_graph.name}.data")
    own_data = kept.graph.with_name(f"{kept.graph.name}.data")
    model = onnx.load(str(kept.graph), load_external_data=False)
    with _mapped(kept.data) as old, _mapped(shared_data) as shared, open(own_data, "wb") as own:
        offsets = _tensor_offsets(shared_graph, shared)
        for tensor in model.graph.initializer:
            if not uses_external_data(tensor):
                continue
            info = ExternalDataInfo(tensor)
            if info.location != kept.location:
                raise ValueError(f"{kept.graph} names weights in {info.location}, not {kept.location}.")
            start = info.offset or 0
            content = old[start : start + info.length]
            found = offsets.get((len(content), hashlib.sha1(content).digest()))
            if found is not None and shared[found : found + len(content)] == content:
                location, offset = shared_data.name, found
            else:
                location, offset = own_data.name, own.tell()
                own.write(content)
            del tensor.external_data[:]
            for key, value in (("location", location), ("offset", offset), ("length", len(content))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
    kept.data.unlink()
    onnx.save_model(model, str(kept.graph))
    return graph_io(kept.graph)


@contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap | bytes]:
    """The file's bytes without reading them all into memory (an empty file cannot be mapped)."""
    if path.stat().st_size == 0:
        yield b""
        return
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        yield mapped


def _tensor_offsets(graph: Path, data) -> dict[tuple[int, bytes], int]:
    """Where each external tensor of `graph` starts in its weights file `data`, by (length, SHA-1 of its bytes)."""
    offsets = {}
    for tensor in onnx.load(str(graph), load_external_data=False).graph.initializer:
        if uses_external_data(tensor):
            info = ExternalDataInfo(tensor)
            start, length = info.offset or 0, info.length
            offsets.setdefault((length, hashlib.sha1(data[start : start + length]).digest()), start)
    return offsets
