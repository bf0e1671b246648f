"""One exported graph in an ONNX Runtime session (`OrtGraph`): inputs checked against the manifest and fed as torch
tensors, through `session.run` on the CPU or IO binding (device pointers, no copies) on CUDA; a decoding graph's calls
with the cache tensors (`DecodingGraph`) and the checks of a decoder's mask and `logits_to_keep`; and the session
options and providers every runtime model uses.
"""

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import onnxruntime as ort
import torch

# Manifest dtype names -> (numpy, torch) dtypes.
TENSOR_DTYPES = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    "int64": (np.int64, torch.int64),
    "int32": (np.int32, torch.int32),
    "bool": (np.bool_, torch.bool),
}
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

logger = logging.getLogger(__name__)


def default_session_options(num_threads: int | None = None, spinning: bool = True) -> ort.SessionOptions:
    """The session options every model uses unless given others: all graph optimizations, and as many intra-op
    threads as this process may use cores (`num_threads` to override, e.g. 1 on a machine shared with others).

    `spinning=False` makes idle intra-op threads sleep instead of busy-waiting for the next node. Spinning saves a
    wake-up per node on an idle machine; on cores shared with other busy processes the spinning threads take the
    time the working one needs (measured: 3-5x slower int8 decode steps of a BART-sized decoder at 2 threads on a
    2-vCPU VM under load, docs/results/benchmark_engines_seq2seq_cpu.md).
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = num_threads or len(os.sched_getaffinity(0))
    options.log_severity_level = 3  # errors only: node-placement notes on CUDA are expected and harmless
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def cuda_provider_options() -> dict[str, str]:
    """ONNX Runtime CUDA provider options that compute as PyTorch does: float32 matrix products on TF32 tensor cores
    only where torch allows them (`torch.backends.cuda.matmul.allow_tf32`, off by default). The provider's own default
    is TF32 on Ampere and later, whose 10-bit mantissa put an fp32 export's logits 3e-3 from PyTorch's (H200)."""
    return {"use_tf32": "1" if torch.backends.cuda.matmul.allow_tf32 else "0"}


def resolve_provider(provider: str) -> str:
    provider = PROVIDERS.get(provider, provider)
    if provider not in PROVIDERS.values():
        raise ValueError(f"provider={provider!r} is not supported; use one of {sorted(PROVIDERS.values())}.")
    if provider not in ort.get_available_providers():
        raise ValueError(
            f"{provider} is not available in this onnxruntime build (available: {ort.get_available_providers()}). "
            f"For CUDA, install onnxruntime-gpu (pip install 'vaswani[gpu]') instead of onnxruntime."
        )
    return provider


Made = TypeVar("Made")


class OnFirstUse(Generic[Made]):
    """What `make` returns, made at the first `get` and once, whichever of a server's threads asks first: the
    runtimes' copies of the weights that only some calls need (an ONNX Runtime session, a second compiled model).

        >>> session = OnFirstUse(lambda: ort.InferenceSession(path))
        >>> session.get().run(None, feeds)
    """

    def __init__(self, make: Callable[[], Made]):
        self.make, self.made, self.lock = make, None, threading.Lock()

    def get(self) -> Made:
        if self.made is None:
            with self.lock:
                if self.made is None:
                    self.made = self.make()
        return self.made


class OrtGraph:
    """One exported graph in an ONNX Runtime session, fed and read as torch tensors.

    `prepare` turns user input into the tensors the manifest asks for, or raises an error that names the input;
    `run` executes the graph. Without IO binding, CPU tensors pass to `session.run` as numpy arrays sharing their
    memory; with IO binding (always on CUDA) inputs and outputs are bound by device pointer, outputs either into
    buffers the caller preallocated or into memory ONNX Runtime allocates and torch then shares through DLPack.

    The session is opened by `open_session`, at load or, where another engine runs most calls (`on_demand`: the
    OpenVINO route), at the first call that needs it: until then ONNX Runtime holds none of the graph's weights.
    """

    def __init__(
        self,
        folder: Path,
        name: str,
        spec: dict,
        open_session: Callable[[], ort.InferenceSession],
        session_options: ort.SessionOptions,
        device: torch.device,
        use_io_binding: bool,
        vocab_size: int,
        on_demand: bool = False,
    ):
        self.folder = folder
        self.name = name
        self.vocab_size = vocab_size
        self.file = spec["file"]
        self.session_options = session_options
        self.device = device
        self.use_io_binding = use_io_binding
        self.inputs = {entry["name"]: entry for entry in spec["inputs"]}
        self.outputs = {entry["name"]: entry for entry in spec["outputs"]}
        self.output_names = list(self.outputs)
        self._session = OnFirstUse(lambda: self.checked(self.opened(open_session)))
        if not on_demand:
            self._session.made = self.checked(open_session())

    @property
    def session(self) -> ort.InferenceSession:
        """The graph's ONNX Runtime session, opened here on first use where the graph was loaded `on_demand`."""
        return self._session.get()

    def opened(self, open_session: Callable[[], ort.InferenceSession]) -> ort.InferenceSession:
        logger.info(
            "ONNX Runtime opens %s now, at the first call the other engine does not run (it held none of the graph's "
            "weights until then)",
            self.file,
        )
        return open_session()

    def checked(self, session: ort.InferenceSession) -> ort.InferenceSession:
        """`session`, once its graph's inputs and outputs are the manifest's."""
        in_graph = {node.name for node in session.get_inputs()}, {node.name for node in session.get_outputs()}
        for kind, listed, actual in zip(("inputs", "outputs"), (self.inputs, self.outputs), in_graph):
            if set(listed) != actual:
                raise ValueError(
                    f"{self.folder / self.file} does not match manifest.json: its {kind} are {sorted(actual)} but "
                    f"the manifest lists {sorted(listed)}. A graph file was replaced after export; export the model "
                    f"again."
                )
        return session

    def prepare(self, values: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Check `values` (torch tensors, numpy arrays or nested lists) against the manifest and return them as
        contiguous torch tensors on the model's device. Integer ids and masks of another integer (or bool) dtype are
        converted to int64; floating-point ids, floats of the wrong precision, a wrong rank or mismatched sizes
        raise an error that names the input."""
        missing = [name for name in self.inputs if values.get(name) is None]
        if missing:
            raise ValueError(f"The {self.name!r} graph needs the inputs {missing}.")
        tensors = {name: self.convert(name, values[name]) for name in self.inputs}
        self._check_axes(tensors)
        if "input_ids" in tensors:
            self._check_token_ids(tensors["input_ids"])
        return tensors

    def convert(self, name: str, value: Any) -> torch.Tensor:
        """One input as the manifest asks for it (see `prepare`, which also checks sizes and token ids once for the
        whole call); a no-op for a tensor that already is."""
        spec = self.inputs[name]
        expected_dtype = TENSOR_DTYPES[spec["dtype"]][1]
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        elif not isinstance(value, torch.Tensor):
            try:
                value = torch.as_tensor(value)
            except (TypeError, ValueError, RuntimeError) as error:
                raise TypeError(f"{name} must be a torch tensor or numpy array, got {type(value).__name__}.") from error
        if value.dtype != expected_dtype:
            is_integer_expected = not expected_dtype.is_floating_point
            if is_integer_expected and not (value.dtype.is_floating_point or value.dtype.is_complex):
                value = value.to(expected_dtype)  # int32 ids, bool masks: same values
            else:
                raise TypeError(
                    f"{name} must have dtype {spec['dtype']} (shape {self._pretty(spec['shape'])}), got {value.dtype}"
                    + (": token ids and masks are integers." if is_integer_expected else ".")
                )
        if value.dim() != len(spec["shape"]):
            raise ValueError(
                f"{name} must have {len(spec['shape'])} dimensions {self._pretty(spec['shape'])}, got shape "
                f"{tuple(value.shape)}."
            )
        return value.to(self.device).contiguous()

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Ids outside the vocabulary fail here with a message, not in the graph's Gather (CPU tensors only: on a
        GPU the check would stall the device)."""
        if input_ids.device.type != "cpu" or not input_ids.numel():
            return
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(
                f"input_ids contain token id {high if high >= self.vocab_size else low}, outside the vocabulary "
                f"[0, {self.vocab_size}). Check that the tokenizer matches the model."
            )

    def _check_axes(self, tensors: dict[str, torch.Tensor]) -> None:
        """Static axes must have their exported size; a named axis (batch, sequence, ...) one size across inputs;
        an axis written as a sum ("past_sequence + sequence") the sum of the sizes of its terms."""
        sizes: dict[str, tuple[int, str]] = {}
        sums = []
        for name, tensor in tensors.items():
            for axis, (want, have) in enumerate(zip(self.inputs[name]["shape"], tensor.shape)):
                if isinstance(want, int) and want != have:
                    raise ValueError(
                        f"{name} has size {have} on axis {axis} but the graph was exported with {want} there "
                        f"(expected shape {self._pretty(self.inputs[name]['shape'])}, got {tuple(tensor.shape)})."
                    )
                if isinstance(want, str) and "+" in want:
                    sums.append((name, axis, want, have))
                elif isinstance(want, str) and sizes.setdefault(want, (have, name))[0] != have:
                    other_size, other = sizes[want]
                    raise ValueError(
                        f"{name} has {want}={have} (shape {tuple(tensor.shape)}) but {other} has {want}={other_size}: "
                        f"inputs must agree on {want}."
                    )
        for name, axis, want, have in sums:
            terms = [term.strip() for term in want.split("+")]
            if all(term.isdigit() or term in sizes for term in terms):
                total = sum(int(term) if term.isdigit() else sizes[term][0] for term in terms)
                if total != have:
                    raise ValueError(
                        f"{name} has size {have} on axis {axis} but needs {want} = {total} "
                        f"(expected shape {self._pretty(self.inputs[name]['shape'])}, got {tuple(tensors[name].shape)})."
                    )

    @staticmethod
    def _pretty(shape: list) -> str:
        return "(" + ", ".join(str(axis) for axis in shape) + ")"

    def run(
        self, inputs: dict[str, torch.Tensor], output_buffers: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Run the graph on prepared `inputs`; outputs named in `output_buffers` are written there (IO binding)."""
        # A no-op for what `prepare` and the graphs produce; a cropped cache (assisted decoding) is a strided view.
        inputs = {name: tensor.contiguous() for name, tensor in inputs.items()}
        if not self.use_io_binding:
            arrays = self.session.run(self.output_names, {name: tensor.numpy() for name, tensor in inputs.items()})
            return {name: torch.from_numpy(array) for name, array in zip(self.output_names, arrays)}
        output_buffers = output_buffers or {}
        binding = self.session.io_binding()
        device_type, device_id = self.device.type, self.device.index or 0
        for name, tensor in inputs.items():
            binding.bind_input(
                name,
                device_type,
                device_id,
                TENSOR_DTYPES[self.inputs[name]["dtype"]][0],
                tuple(tensor.shape),
                tensor.data_ptr(),
            )
        for name, spec in self.outputs.items():
            buffer = output_buffers.get(name)
            if buffer is None:  # ONNX Runtime allocates it on the device; torch shares it below
                binding.bind_output(name, device_type, device_id)
            else:
                binding.bind_output(
                    name, device_type, device_id, TENSOR_DTYPES[spec["dtype"]][0], tuple(buffer.shape), buffer.data_ptr()
                )
        # Belt and braces for inputs written, and outputs read, by torch on another stream than ONNX Runtime's
        # (from_pretrained points ORT at torch's current stream; a user may switch streams later).
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        values = binding.get_outputs()
        return {
            name: output_buffers[name] if name in output_buffers else torch.from_dlpack(value)
            for name, value in zip(self.output_names, values)
        }


class DecodingGraph:
    """A decoding graph's calls with the cache as its past inputs and present outputs: `run` on torch tensors (with IO
    binding, the present tensors written into the caller's buffers), `run_arrays` on numpy arrays."""

    def __init__(self, graph: OrtGraph, past_names: list[str], present_names: list[str]):
        self.graph, self.past_names, self.present_names = graph, past_names, present_names

    def run(
        self, inputs: dict[str, torch.Tensor], past: list[torch.Tensor], buffers: Any
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call: logits (batch, sequence, vocab) and the present cache tensors. `buffers` (a
        `generation.KVBuffers`, or None) holds the present tensors' memory under IO binding."""
        feeds = {**inputs, **dict(zip(self.past_names, past))}
        output_buffers = None
        if buffers is not None:
            length = past[0].shape[2] + inputs["input_ids"].shape[1]
            output_buffers = dict(zip(self.present_names, buffers.present_views(past[0], length)))
        outputs = self.graph.run(feeds, output_buffers)
        return outputs["logits"], [outputs[name] for name in self.present_names]

    def run_arrays(
        self, inputs: dict[str, torch.Tensor], past: list[np.ndarray], session: Any = None
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """`run` on the CPU without IO binding, with the cache as numpy arrays in and out: the 2 x layers cache tensors
        skip the torch round trip of every step (0.2 ms a token on a 30-layer model). `inputs` are the prepared,
        contiguous CPU tensors; `session` another one that runs the same graph (default: the graph's own)."""
        graph = self.graph
        feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
        feeds.update(zip(self.past_names, past))
        arrays = (session or graph.session).run(graph.output_names, feeds)
        outputs = dict(zip(graph.output_names, arrays))
        return torch.from_numpy(outputs["logits"]), [outputs[name] for name in self.present_names]


def checked_mask(attention_mask: Any, batch: int, total: int, device: torch.device) -> Any:
    """`attention_mask` checked against the (batch, cached + new tokens) shape the input needs; all ones if None."""
    if attention_mask is None:
        return torch.ones(batch, total, dtype=torch.int64, device=device)
    if tuple(attention_mask.shape) != (batch, total):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, but the input needs (batch, past_sequence + "
            f"sequence) = {(batch, total)}: one entry per cached and new token, 1 to attend and 0 for padding."
        )
    return attention_mask


def logits_positions(logits_to_keep: int | torch.Tensor, length: int) -> torch.Tensor:
    """The `logits_positions` graph input for transformers' `logits_to_keep` over `length` new tokens: 0 keeps
    every position, n the last n, and a 1-D tensor lists the positions (negative ones count from the end)."""
    if isinstance(logits_to_keep, int) and logits_to_keep >= 0:
        start = max(length - logits_to_keep, 0) if logits_to_keep else 0
        return torch.arange(start, length)
    positions = torch.as_tensor(logits_to_keep)
    if positions.dim() != 1 or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(
            f"logits_to_keep must be a non-negative int or a 1-D integer tensor of positions, got {logits_to_keep!r}."
        )
    if positions.numel() and not (-length <= int(positions.min()) and int(positions.max()) < length):
        raise ValueError(f"logits_to_keep holds positions outside the {length} new tokens: {positions.tolist()}.")
    return positions % max(length, 1)  # counted from the start, as the exported index_select counts them
