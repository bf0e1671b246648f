"""OpenVINO as a second engine for an exported decoder folder (`pip install 'vaswani[openvino]'`): the same portable
graph file, compiled by OpenVINO for the CPU, stateful (`OpenVinoDecoder`) or as it is (`OpenVinoSession`, what
validation runs other graphs with). The decoder runtime built on it, which routes each call and supplies the server's
batch, is `decoders/openvino.py` (`OpenVinoRuntime`).

Why. ONNX Runtime's CPU provider has no bfloat16 or AMX matrix products; OpenVINO computes in bfloat16 where the
CPU has AVX512_BF16 or AMX, and where it has VNNI multiplies int8/int4 weights by activations it quantizes to int8 in
groups of 32, which ran quantized exports' batches faster than ONNX Runtime's `MatMulNBits` (docs/deployment.md).
The graph is compiled once, made stateful (`make_stateful`, `OpenVinoDecoder`): its cache lives in an infer request,
the form OpenVINO's CPU plugin fuses into one attention-with-cache kernel (the cache appended in place, grouped-query
heads read without copies), as in OpenVINO GenAI's own models. Run stateless,
with the cache passed in and out on every call, the same graph spent about half of a decode step outside its
kernels and lost every decode step to ONNX Runtime (docs/results/openvino_route_cpu.md).

What runs where (docs/results/openvino_route_1b_cpu.md has the measurements):
- prompts and prefill chunks (more than one token per row): OpenVINO;
- `generate`'s greedy/sampling loop: every step in OpenVINO with the cache held in the request, where
  `OpenVinoRuntime.decodes_in_openvino` (an unquantized export, or two rows or more); one-token steps of a quantized
  export's single row run in ONNX Runtime, whose `MatMulNBits` kernels decoded those faster. A quantized export's
  steps compute in f32 beside bf16 prompts where "auto" chose bf16 and the CPU has int8 dot products
  (`decode_step_precision`: a second compiled graph, which takes the prompt's cache over once), a single row's too
  where the export is large (`decoders.openvino.ONE_ROW_OPENVINO_BYTES`);
  on AMX at bf16 a prompt is padded on the left to a multiple of 128 tokens (`amx_left_padding`);
- the server's prompts and running batch: the graph's paged form (`make_paged`, `decoders/paged.py`);
- other one-token calls (`forward`, beam search): ONNX Runtime (`OpenVinoRuntime` routes each call by its length).
The stateless hand-over works because the portable graph's cache is plain (batch, heads, length, head_dim) tensors:
OpenVINO's state is written from and read into them. The cost is memory, held only where used: the graph is read
once, its quantized weights from the export's data file in place (`openvino_weights`), each compiled model lays the
weights out for its kernels at its first run, the f32 steps' model is compiled at the first step that needs it, and
ONNX Runtime's session is opened at the first call left to it (`session.OrtGraph.session`).

    >>> model = OrtModelForCausalLM.from_pretrained("onnx-folder", engine="openvino")       # bf16 where the CPU has it
    >>> model = OrtModelForCausalLM.from_pretrained("onnx-folder", engine="openvino", openvino_precision="f32")
    >>> OpenVinoSession("onnx-folder/model.onnx", precision="bf16", threads=2).run(None, feeds)  # any graph, stateless
"""

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .contract import is_gqa_form, positions_from_mask
from .held_cache import NotLeftPaddedError, refuse_capacity_past, refuse_step_past
from .openvino_forms import make_stateful
from .openvino_weights import FileWeights, map_file_weights
from .session import OnFirstUse

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "f32", "bf16")
# What OpenVINO calls the precisions (its INFERENCE_PRECISION_HINT); `OrtModel.provider` reports "OpenVINO (bf16)".
OPENVINO_TYPES = {"f32": "f32", "bf16": "bf16"}
PROVIDER_NAME = "OpenVINO"


def import_openvino():
    try:
        import openvino
    except ImportError as error:
        raise ImportError(
            f"engine='openvino' needs OpenVINO ({error}); install it with pip install 'vaswani[openvino]'."
        ) from error
    return openvino


def route_description(provider: str) -> str:
    """How `engine="openvino"` splits the work, for logs and benchmark results; `provider` is what
    `OrtModel.provider` reports ("OpenVINO (bf16)")."""
    return (
        f"prompts in {provider}, decode steps too where faster (unquantized exports; quantized ones from two rows), "
        f"other one-token steps in ONNX Runtime"
    )


def check_precision(precision: str) -> None:
    """Raise a ValueError naming the choices for an unknown OpenVINO `precision`."""
    if precision not in PRECISIONS:
        raise ValueError(f"openvino_precision={precision!r} is not supported; use one of {list(PRECISIONS)}.")


# CPU flags of int8 dot-product instructions: where OpenVINO's CPU plugin multiplies compressed int8/int4 weights by
# activations it quantizes to int8 in groups of 32 (its DYNAMIC_QUANTIZATION_GROUP_SIZE default).
INT8_DOT_PRODUCT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU's flags as /proc/cpuinfo lists them; empty where it cannot tell (other operating systems)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    return next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])


def cpu_has_int8_dot_products(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU lists one of `INT8_DOT_PRODUCT_FLAGS` (VNNI or AMX int8); False where /proc/cpuinfo cannot
    tell (other operating systems), which keeps `engine="auto"` on ONNX Runtime for quantized exports there."""
    flags = cpu_flags(cpuinfo)
    return any(flag in flags for flag in INT8_DOT_PRODUCT_FLAGS)


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU lists AMX's bfloat16 tiles (`amx_bf16`), which OpenVINO's bf16 matrix products run on."""
    return "amx_bf16" in cpu_flags(cpuinfo)


# On AMX, OpenVINO's bf16 products over compressed weights take longer for a call whose token count (rows x columns)
# falls short of a multiple of 128 than for the multiple above it: a Llama-3.2-1B-shaped int8 export's prompt of 456
# tokens took 954 ms against 802 for 512, 448 tokens 878 ms, 96 tokens 236 ms against 215 for 128 (an Intel Xeon,
# 2 threads: docs/results/openvino_prompt_sizes_1b_amx.md). Up to 64 tokens time grows with the count. So
# `OpenVinoDecoder.start` pads such a prompt on the left, under a zero mask, to the multiple.
AMX_TOKEN_MULTIPLE = 128


def amx_left_padding(rows: int, columns: int) -> int:
    """The columns of left padding that bring a call of `rows` x `columns` tokens to a multiple of
    `AMX_TOKEN_MULTIPLE` for fewer than that many padding tokens; 0 for calls of 64 tokens or fewer, at a multiple
    already, or where the multiple takes more padding."""
    if rows * columns <= 64:
        return 0
    extra = next(extra for extra in range(AMX_TOKEN_MULTIPLE + 1) if rows * (columns + extra) % AMX_TOKEN_MULTIPLE == 0)
    return extra if rows * extra < AMX_TOKEN_MULTIPLE else 0


def openvino_precision(requested: str = "auto") -> str:
    """The compute precision OpenVINO runs in: `requested` when it is "f32" or "bf16", else ("auto") "bf16" where the
    CPU computes bfloat16 natively (AVX512_BF16 or AMX: OpenVINO lists "BF16" among the CPU's optimization
    capabilities) and "f32" elsewhere. Forced "bf16" on a CPU without it runs, emulated and slower."""
    check_precision(requested)
    if requested != "auto":
        return requested
    capabilities = import_openvino().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return "bf16" if "BF16" in capabilities else "f32"


def decode_step_precision(requested: str, precision: str, quantized: bool) -> str:
    """The compute precision of OpenVINO's decode steps, beside prompts computed in `precision` (resolved from
    `requested`): "f32" for a `quantized` export whose prompts compute in bf16 because `requested` was "auto", on a
    CPU with int8 dot products (VNNI or AMX int8); else `precision`, as the prompts.

    Why: at f32 compute the CPU plugin multiplies int8/int4 weights by activations it quantizes to int8 (its dynamic
    quantization), reading the weights as they are stored; at bf16 it converts them to bf16 first. That conversion
    costs more than AMX's bf16 products save when a call has a few rows, and less when it has hundreds. On an Intel
    Xeon with AMX, a Llama-3.2-1B-shaped int8 export (`--block-size 128`) decodes 8 rows at 92.6 tok/s with f32
    steps against 58.4 with bf16 ones, while OpenVINO GenAI's int8 takes 1172 ms for a 512-token prompt at f32
    against 746 at bf16 (docs/results/benchmark_engines_openvino_steps_1b_amx.md and _bf16_steps_1b_amx.md). An
    explicit "bf16" or "f32" keeps every call in it."""
    if requested == "auto" and precision == "bf16" and quantized and cpu_has_int8_dot_products():
        logger.info(
            "OpenVINO: prompts compute in bf16, decode steps of the quantized weights in f32 with int8 activations "
            "(faster at few rows; a second compiled copy of the weights); openvino_precision='bf16' keeps all in bf16"
        )
        return "f32"
    return precision


class OpenVinoSession:
    """One exported graph compiled by OpenVINO for the CPU as it is (stateless), run like an ONNX Runtime session: what
    validation runs graphs other than a text-generation decoder with (the decoder runs as `OpenVinoDecoder`).

    `precision` is "f32" or "bf16" (see `openvino_precision`), `threads` OpenVINO's inference threads (as ONNX
    Runtime's intra-op threads). Inputs are read in place (`share_inputs`), outputs copied out, so a returned array
    stays valid after the next run. One infer request, guarded by a lock: calls from several threads take turns.

    Example:
        >>> session = OpenVinoSession("onnx-folder/model.onnx", precision="bf16", threads=2)
        >>> logits, *present = session.run(None, feeds)   # feeds: name -> numpy array, as ONNX Runtime takes them
    """

    def __init__(self, path: str | Path, precision: str, threads: int):
        self.path, self.precision, self.threads = Path(path), precision, threads
        core, model, self.weights = read_graph(self.path)
        properties = {"INFERENCE_PRECISION_HINT": OPENVINO_TYPES[precision], "INFERENCE_NUM_THREADS": int(threads)}
        self.compiled = core.compile_model(model, "CPU", properties)
        self.request = self.compiled.create_infer_request()
        self.input_names = [port.get_any_name() for port in self.compiled.inputs]
        self.output_names = [port.get_any_name() for port in self.compiled.outputs]
        self.output_ports = dict(zip(self.output_names, self.compiled.outputs))
        self.lock = threading.Lock()

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray], run_options: Any = None) -> list:
        """The outputs named (all, in graph order, for None) of one inference on `feeds`, as numpy arrays."""
        with self.lock:
            results = self.request.infer(feeds, share_inputs=True, share_outputs=False)
        return [results[self.output_ports[name]] for name in output_names or self.output_names]


class OpenVinoDecoder:
    """A portable decoder graph compiled by OpenVINO with its cache inside: what `generate` runs every step in where
    `OpenVinoRuntime.decodes_in_openvino` says so, and where `vaswani serve --engine openvino` keeps its running
    batch's cache between steps for graphs without the paged form (`decoders.openvino.OpenVinoBatch`); `run` is the
    stateless call (prompts, validation).

    Each infer request (`new_request`) holds one cache, so concurrent generations do not share one. For the lean loop
    it is a `held_cache.HeldCacheDecoder`, as `GqaDecoder` is: `start` prefills a left-padded prompt and returns the
    state its decode steps continue, `decode` appends one token per row. The graph is made stateful as OpenVINO
    GenAI's models are (`make_stateful`); the cache is kept in float16 for bf16 compute and in float32 for f32.

    Example:
        >>> decoder = OpenVinoDecoder("onnx-folder/model.onnx", manifest, "bf16", threads=2, max_positions=8192)
        >>> logits, state = decoder.start(input_ids, attention_mask)   # (batch, vocab): each row's last token
        >>> logits = decoder.decode(state, logits.argmax(-1))
    """

    def __init__(
        self,
        path: str | Path,
        manifest: dict,
        precision: str,
        threads: int,
        max_positions: int | None = None,
        step_precision: str | None = None,
    ):
        self.path, self.precision, self.threads = Path(path), precision, threads
        self.step_precision = step_precision or precision
        # `weights` holds the data file's mapping, which the graph's quantized weights read from: every compiled
        # model made from this graph reads them there, so whatever holds one holds this (`PagedStepModel` too).
        self.core, model, self.weights = read_graph(self.path)
        warn_partial_blocks(self.path)
        # The graph as read, before it is made stateful: the paged form starts from a copy (`read_copy`). Copies share
        # its weights.
        self.graph_as_read = model.clone()
        self.input_names = [port.get_any_name() for port in model.inputs]  # the stateless graph's, for `run`
        self.output_names = [port.get_any_name() for port in model.outputs]
        pairs = make_stateful(model, manifest)
        self.past_names, self.present_names = list(pairs), list(pairs.values())
        self.stateful_model = model
        self.compiled = self.compile(model, precision)
        self.logits_index = [port.get_any_name() for port in self.compiled.outputs].index("logits")
        # Decode steps in another precision (`step_precision`) run a second compiled model, which holds weights of
        # its own (1.3 GB at 1B int8): compiled at the first step that needs it (`step_compiled`), never in a
        # server, whose batch runs the paged form. Its requests take the cache over from the prompt's once (`start`).
        self._step_compiled = OnFirstUse(self.compiled_steps) if self.splits_steps else None
        self.pads_prompts = precision == "bf16" and cpu_has_amx()  # `amx_left_padding`
        if self.pads_prompts:
            logger.info(
                "OpenVINO: prompts padded on the left to a multiple of %d tokens, which AMX's bf16 products run "
                "faster than the count below it",
                AMX_TOKEN_MULTIPLE,
            )
        # OpenVINO names each state by its past input and present output; the cache's order is the inputs'.
        self.state_order = {past + present: index for index, (past, present) in enumerate(pairs.items())}
        self.max_positions = max_positions

    def compile(self, model: Any, precision: str) -> Any:
        """The stateful graph compiled for the CPU at `precision`, its cache in float16 for bf16 compute and in
        float32 for f32."""
        properties = {
            "INFERENCE_PRECISION_HINT": OPENVINO_TYPES[precision],
            "INFERENCE_NUM_THREADS": int(self.threads),
            "KV_CACHE_PRECISION": "f16" if precision == "bf16" else "f32",
        }
        return self.core.compile_model(model, "CPU", properties)

    @property
    def splits_steps(self) -> bool:
        """Whether decode steps compute in another precision than prompts (a second compiled model)."""
        return self.step_precision != self.precision

    @property
    def step_compiled(self) -> Any:
        """The compiled model of the decode steps: the prompts' own, or where `splits_steps`, the steps' one,
        compiled on first use (`compile_steps`)."""
        return self.compile_steps()

    def compile_steps(self) -> Any:
        """The decode steps' compiled model, compiled now where it was not yet (`step_compiled`)."""
        return self.compiled if self._step_compiled is None else self._step_compiled.get()

    def compiled_steps(self) -> Any:
        compiled = self.compile(self.stateful_model, self.step_precision)
        # The CPU plugin lays out a graph's compressed weights for its kernels at its first run (0.44 s for a 1B int8
        # graph at f32): done here, not inside the first timed step.
        one = np.ones((1, 1), dtype=np.int64)
        self.infer(compiled.create_infer_request(), one, one, one - 1)
        return compiled

    def read_copy(self) -> Any:
        """The graph as read (stateless), a copy to transform: it shares the weights in memory."""
        return self.graph_as_read.clone()

    plain_greedy = None  # greedy search runs `held_cache_sample`'s own loop

    @property
    def provider(self) -> str:
        """What runs it, as `OrtModel.provider` reports it: "OpenVINO (bf16)", or "OpenVINO (bf16 prompts, f32
        steps)" where decode steps compute in another precision."""
        if not self.splits_steps:
            return f"{PROVIDER_NAME} ({self.precision})"
        return f"{PROVIDER_NAME} ({self.precision} prompts, {self.step_precision} steps)"

    def check_capacity(self, length: int) -> None:
        """Refuse a step past the rotary table's positions."""
        refuse_step_past(length, self.max_positions)

    def new_request(self) -> Any:
        """An infer request whose cache starts empty (for the batch of its first run)."""
        return self.compiled.create_infer_request()

    def new_step_request(self) -> Any:
        """An infer request of the decode steps' compiled graph (the prompts' where both compute alike)."""
        return self.step_compiled.create_infer_request()

    def infer(self, request: Any, input_ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Feed `input_ids` (batch, new) after the request's cache, under `mask` (batch, cached + new) at `positions`
        (batch, new); the cache grows by the new tokens. Returns the last column's logits (batch, vocab), a copy."""
        feeds = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "attention_mask": np.ascontiguousarray(mask, dtype=np.int64),
            "logits_positions": np.array([input_ids.shape[1] - 1], dtype=np.int64),
            "beam_idx": np.arange(input_ids.shape[0], dtype=np.int32),  # every row kept, in order
        }
        if "position_ids" in self.input_names:  # graphs whose positions do not use them (ALiBi) have none
            feeds["position_ids"] = np.ascontiguousarray(positions, dtype=np.int64)
        request.infer(feeds, share_inputs=True)
        return request.get_output_tensor(self.logits_index).data[:, -1].copy()

    def read_cache(self, request: Any) -> list[np.ndarray]:
        """The request's cache as the graph's present tensors, (batch, kv_heads, length, head_dim) each, in order."""
        cache = [None] * len(self.state_order)
        for state in request.query_state():
            cache[self.state_order[state.name]] = state.state.data.copy()
        return cache

    def write_cache(self, request: Any, cache: list[np.ndarray]) -> None:
        """Replace the request's cache by `cache` (as `read_cache` returns it, or a graph's present tensors)."""
        openvino = import_openvino()
        for state in request.query_state():
            state.state = openvino.Tensor(np.ascontiguousarray(cache[self.state_order[state.name]]))

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray], run_options: Any = None) -> list:
        """ONNX Runtime's `run` on the stateless graph's inputs and outputs (what `OrtGraph`, the route and validation
        call): the past tensors written into a new request's cache, the present ones read back out. Returns the
        outputs named (all, in graph order, for None) as numpy arrays."""
        request = self.new_request()
        past = [feeds[name] for name in self.past_names]
        if past[0].shape[2]:  # else the request's cache starts empty, for the batch of this run
            self.write_cache(request, past)
        inputs = {name: feeds[name] for name in self.input_names if name in feeds and name not in self.past_names}
        request.infer({**inputs, "beam_idx": np.arange(past[0].shape[0], dtype=np.int32)}, share_inputs=True)
        outputs = dict(zip(self.present_names, self.read_cache(request)))
        outputs["logits"] = request.get_output_tensor(self.logits_index).data.copy()
        return [outputs[name] for name in output_names or self.output_names]

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int | None = None
    ) -> tuple[torch.Tensor, "OpenVinoState"]:
        """Prefill a left-padded prompt in a new request: each row's last token's logits (batch, vocab) and the decode
        steps' state. Raises `NotLeftPaddedError` where the last column holds padding."""
        logits, state = self.prefill(input_ids, attention_mask, capacity)
        if self.splits_steps:  # the steps' graph takes the prompt's cache over
            steps = self.new_step_request()
            self.write_cache(steps, self.read_cache(state.request))
            state.request = steps
        return logits, state

    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int | None = None
    ) -> tuple[torch.Tensor, "OpenVinoState"]:
        """`start` up to the prompt's cache, in a request of the prompts' compiled graph: its columns are `state.mask`'s
        (more than the prompt's where it was padded for AMX)."""
        refuse_capacity_past(capacity, self.max_positions)
        mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
        if not bool(mask[:, -1].all()):
            raise NotLeftPaddedError
        if self.pads_prompts and (extra := amx_left_padding(*input_ids.shape)):
            input_ids = torch.nn.functional.pad(input_ids, (extra, 0))  # token 0 under a zero mask: never attended
            mask = torch.nn.functional.pad(mask, (extra, 0))
        positions = positions_from_mask(mask).numpy()  # as generate makes them
        mask = mask.to(torch.int64).numpy()
        state = OpenVinoState(self.new_request(), mask, positions[:, -1:] + 1)
        logits = self.infer(state.request, input_ids.numpy(), mask, positions)
        return torch.from_numpy(logits), state

    def decode(self, state: "OpenVinoState", tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (batch,): the (batch, vocab) logits of the next."""
        state.mask = np.concatenate([state.mask, np.ones((state.mask.shape[0], 1), dtype=np.int64)], 1)
        logits = self.infer(state.request, tokens.numpy()[:, None], state.mask, state.next_positions)
        state.next_positions = state.next_positions + 1
        return torch.from_numpy(logits)


@dataclass
class OpenVinoState:
    """One generate call's cache (inside `request`), its attention mask so far and each row's next position."""

    request: Any
    mask: np.ndarray  # (batch, tokens held) int64
    next_positions: np.ndarray  # (batch, 1) int64


def read_graph(path: Path) -> tuple[Any, Any, FileWeights]:
    """OpenVINO's `Core`, the graph at `path` as its ONNX reader reads it, its quantized weights read from the data
    file in place (`openvino_weights.map_file_weights`), and what holds that file's mapping: keep it as long as the
    graph or anything compiled from it. A graph it cannot read raises a ValueError naming the fix
    (`unreadable_graph_message`)."""
    core = import_openvino().Core()
    with readable_graph_path(path) as readable:
        try:
            graph = core.read_model(str(readable))
        except RuntimeError as error:
            raise ValueError(unreadable_graph_message(path, error)) from error
        return core, graph, map_file_weights(graph, readable)


@contextmanager
def readable_graph_path(path: Path) -> Iterator[Path]:
    """`path`, or a path to the same graph that OpenVINO reads. Its ONNX reader refuses external data that resolves
    outside the graph's folder, which is how the Hugging Face Hub's cache stores a download (each file a symlink into
    the cache's blobs). Then the graph and its data files are hard-linked under their own names into a temporary
    folder beside the data (no copy), which is removed once read: OpenVINO has mapped the data by then."""
    import onnx

    folder = path.parent
    graph = onnx.load(str(path), load_external_data=False).graph
    locations = {
        entry.value
        for tensor in graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    outside = [name for name in locations if (folder / name).resolve().parent != folder.resolve()]
    if not outside:
        yield path
        return
    data = (folder / outside[0]).resolve()
    try:
        linked = Path(tempfile.mkdtemp(prefix=".openvino-", dir=data.parent))
    except OSError as error:
        raise ValueError(linked_data_message(folder, outside[0], data, error)) from error
    try:
        for name in [path.name, *sorted(locations)]:
            os.link((folder / name).resolve(), linked / name)
        yield linked / path.name
    except OSError as error:
        raise ValueError(linked_data_message(folder, outside[0], data, error)) from error
    finally:
        shutil.rmtree(linked, ignore_errors=True)


def linked_data_message(folder: Path, name: str, data: Path, error: Exception) -> str:
    return (
        f"OpenVINO reads a graph's external data only from inside the graph's folder, and {folder / name} links to "
        f"{data}, outside {folder} (as the Hugging Face Hub's cache stores files); linking the files side by side "
        f"failed ({error}). Copy the folder without links (cp -rL, or huggingface_hub's "
        f"snapshot_download(..., local_dir=...)) and load the copy."
    )


def warn_partial_blocks(path: Path) -> None:
    """Warn where the graph's `MatMulNBits` weights have a row length (K) that is not a multiple of their block
    size: OpenVINO's CPU plugin keeps such int8 weights as float32 (measured: SmolLM2-360M's K=960 at `--block-size
    128` decoded 8 rows at half the speed of block 32, docs/results/benchmark_engines_openvino_block32_360m_amx.md)."""
    import onnx

    partial = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}
            if attributes["K"] % attributes["block_size"]:
                partial[attributes["K"]] = attributes["block_size"]
    if partial:
        rows = ", ".join(f"K={k} at block {block}" for k, block in sorted(partial.items()))
        logger.warning(
            "Quantized weights whose rows are not a whole number of blocks (%s): OpenVINO's CPU plugin keeps such "
            "int8 weights as float32, reading 4 bytes a weight. For --engine openvino, export with a --block-size "
            "that divides every K (e.g. 32).",
            rows,
        )


def unreadable_graph_message(path: Path, error: Exception) -> str:
    """Why OpenVINO could not read `path`, with the fix: the ONNX Runtime-only operators it holds (the
    GroupQueryAttention form and fused norms of quantized and --optimize exports), which a portable export avoids."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    contrib = sorted({node.op_type for node in graph.node if node.domain not in ("", "ai.onnx")})
    detail = f" It holds ONNX Runtime-only operators: {', '.join(contrib)}." if contrib else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"OpenVINO cannot read {path} ({first_line}).{detail} Export the model again with "
        f"`vaswani export --attention portable` (and without --optimize) for a graph that OpenVINO reads."
    )


def unreadable_form_refusal(folder: Path, manifest: dict) -> str | None:
    """Why OpenVINO cannot run `folder`'s decoder, with the fix, where it is the GroupQueryAttention form (ONNX
    Runtime-only); else None."""
    if not is_gqa_form(manifest):
        return None
    return (
        f"{folder} holds the GroupQueryAttention form of the decoder (com.microsoft.GroupQueryAttention, what "
        f"--quantize and --optimize write by default), which only ONNX Runtime runs, and no portable graph beside it "
        f"(an export for the CPU by this version carries one). For engine='openvino', export the model again: "
        f"`vaswani export` writes the portable graph beside that form, `--attention portable` that graph alone."
    )


def refuse_unreadable_form(folder: Path, manifest: dict) -> None:
    """Refuse, before compiling anything, a folder whose decoder is the GroupQueryAttention form (ONNX Runtime-only)."""
    refusal = unreadable_form_refusal(folder, manifest)
    if refusal is not None:
        raise ValueError(refusal)
