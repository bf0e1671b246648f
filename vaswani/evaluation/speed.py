"""Time to first token and decode tokens/s of one causal LM folder (PyTorch or ONNX export) on
this machine, against the bound that memory bandwidth sets.

A decode step reads every weight once, so a batch-1 decode can reach at most bandwidth / weight bytes tokens/s; the
bandwidth is measured here (a streaming read of a buffer much larger than the last-level cache, on as many threads as
the decode computes on: one core alone reads less than two) and the weight bytes
are the graph's initializers (quantized ones at their packed size) or the PyTorch model's parameters, less the
embedding tables a step only looks rows up in. Each batch size
decodes fixed prompts of seeded random token ids, never stopping early, so every row decodes the same count.

    $ vaswani bench outputs/chat-onnx-int8 --batch-sizes 1 8 --prompt-tokens 128 --new-tokens 64 --json bench.json

From Python:

    >>> from vaswani.evaluation.speed import bench_folder
    >>> result = bench_folder("outputs/chat-onnx-int8", batch_sizes=(1,), prompt_tokens=32, new_tokens=16)
    >>> result.rows[0].decode_tokens_per_s, result.rows[0].bound_fraction  # doctest: +SKIP
"""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime.loading import LoadedFolder

PROMPT_SEED = 0


@dataclass
class BenchRow:
    """One batch size: prefill time of the batch's prompts (to its first token), and the decode of the rest.

    `bound_fraction` is decode steps per second over the bandwidth bound's (one step reads the weights once, whatever
    the batch)."""

    batch_size: int
    prompt_tokens: int
    new_tokens: int
    generated_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    bound_fraction: float


@dataclass
class BenchResult:
    """A folder's benchmark: the machine, the weight bytes a decode step reads, the measured memory bandwidth, the
    batch-1 bound (bandwidth / weight bytes, tokens/s) and one row per batch size. `bandwidth_threads` is how many
    CPU threads read the bandwidth probe's buffer: the decode's own (`machine["threads"]`); None on a GPU."""

    folder: str
    form: str
    device: str
    machine: dict[str, Any]
    weight_bytes: int
    bandwidth_bytes_per_s: float
    bound_tokens_per_s: float
    rounds: int
    rows: list[BenchRow] = field(default_factory=list)
    # The runtime that ran it: pytorch, onnxruntime, or the OpenVINO route (`--engine openvino`); the JSON key is
    # "engine", as the flag's name.
    engine: str = "onnxruntime"
    bandwidth_threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @property
    def runtime_note(self) -> str:
        return "" if self.engine == "onnxruntime" or self.form != "onnx" else f", {self.engine}"

    @property
    def probe_note(self) -> str:
        threads = self.bandwidth_threads
        return "" if threads is None else f" (read on {threads} thread{'s' if threads > 1 else ''}, as the decode)"

    def table(self) -> str:
        """The result as a Markdown table, under a line naming the machine and the bound."""
        machine = self.machine
        lines = [
            f"{self.folder} ({self.form} on {self.device}{self.runtime_note}); {machine['cpu']}, {machine['cores']} cores, "
            f"{machine['threads']} threads; {machine['torch']}",
            f"weights {self.weight_bytes / 1e6:.1f} MB, memory bandwidth {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s"
            f"{self.probe_note}: "
            f"batch-1 decode bound {self.bound_tokens_per_s:.1f} tokens/s (median of {self.rounds} rounds)",
            "",
            "| batch | prompt tokens | new tokens | time to first token | decode tokens/s | of the bound |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in self.rows:
            lines.append(
                f"| {row.batch_size} | {row.prompt_tokens} | {row.new_tokens} | "
                f"{row.time_to_first_token_s * 1e3:.1f} ms | {row.decode_tokens_per_s:.1f} | {row.bound_fraction:.0%} |"
            )
        return "\n".join(lines)


def initializer_bytes(graph_path: str | os.PathLike) -> dict[str, int]:
    """Bytes of each initializer of an ONNX graph, by name, at its stored size (packed int4/int8 weights, scales and
    zero points included), read from the graph's header without loading external data."""
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    sizes = {}
    for tensor in graph.initializer:
        count = 1
        for dim in tensor.dims:
            count *= dim
        sizes[tensor.name] = count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return sizes


# Inputs that an operator reads one row of per token: (op type, input index). `Gather`'s data; the rotary tables
# (cos_cache, sin_cache) of ONNX Runtime's GroupQueryAttention, read at each token's position: at a Llama-3.2-1B
# shape they are 34 MB (131,072 positions), 4% of what an int4 decode step reads.
ROW_LOOKUPS = {("Gather", 0), ("GroupQueryAttention", 7), ("GroupQueryAttention", 8)}


def lookup_tables(graph_path: str | os.PathLike) -> set[str]:
    """Initializers an ONNX graph only looks rows up in (every reader one of `ROW_LOOKUPS`): token and learned
    position embeddings and GroupQueryAttention's rotary tables, of which a decode step reads one row per token, not
    the table."""
    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    readers: dict[str, list[bool]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, index) in ROW_LOOKUPS)
    return {tensor.name for tensor in graph.initializer if readers.get(tensor.name) and all(readers[tensor.name])}


def graph_weight_bytes(graph_path: str | os.PathLike) -> int:
    """Bytes of weights a decode step of an ONNX graph reads: its initializers less its `lookup_tables`."""
    tables = lookup_tables(graph_path)
    return sum(size for name, size in initializer_bytes(graph_path).items() if name not in tables)


def weight_bytes(loaded: "LoadedFolder") -> int:
    """Bytes of weights a decode step reads: the decoding graph's initializers, or the PyTorch model's parameters (a
    tied embedding counted once), less the tables it only looks rows up in (an untied or learned-position
    embedding: one row per token, where counting the table would understate the bound, by 1 GB of a 2.5 GB int8
    Llama-3.2-1B-shaped export)."""
    if loaded.form == "onnx":
        return graph_weight_bytes(loaded.folder / loaded.model.graphs[loaded.model.decoding_graph].file)
    import torch

    modules = list(loaded.model.modules())
    tables = {id(module.weight) for module in modules if isinstance(module, torch.nn.Embedding)}
    tables -= {id(getattr(module, "weight", None)) for module in modules if not isinstance(module, torch.nn.Embedding)}
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters() if id(p) not in tables)


def decode_threads(loaded: "LoadedFolder") -> int:
    """The CPU threads a decode step of `loaded` computes on: an ONNX export's intra-op threads (whatever decoder
    runtime runs it: the OpenVINO runtime is given ONNX Runtime's count), a PyTorch model's torch threads."""
    import torch

    if loaded.form != "onnx":
        return torch.get_num_threads()
    options = loaded.model.graphs[loaded.model.decoding_graph].session_options
    # 0 asks ONNX Runtime for its own default, one thread per core.
    return options.intra_op_num_threads or len(os.sched_getaffinity(0))


def runtime_name(loaded: "LoadedFolder") -> str:
    """What runs `loaded` (`BenchResult.engine`): "pytorch"; "onnxruntime" for ONNX Runtime's own decoder runtimes
    (portable, GroupQueryAttention); else the decoder runtime's line, e.g. the OpenVINO route's."""
    if loaded.form != "onnx":
        return loaded.form
    from ..runtime.decoders import DEFAULT_ENGINE

    runtime = loaded.model.decoder_runtime
    return DEFAULT_ENGINE if runtime.engine == DEFAULT_ENGINE else runtime.description


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op pool at `count` threads inside the block (None: as it is), as it was after it."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def memory_bandwidth(
    device: str = "cpu",
    megabytes: int = 1024,
    rounds: int = 5,
    summary: Callable[[list[float]], float] = max,
    threads: int | None = None,
) -> float:
    """Memory read bandwidth in bytes/s: each pass times a sum over a `megabytes` float32 buffer and a
    matrix-vector product over the same buffer, and keeps the faster; `summary` (default the best) of `rounds` passes
    after one untimed. The buffer must be much larger than the last-level cache. Reading, not copying, because a
    decode step reads its weights: a copy also writes (and on CPUs first reads the lines it writes), and measured
    22 GB/s on a machine where a 1B fp32 export's decode read its weights at 30 GB/s and a sum at 29 GB/s. The
    product is the decode's own kind of read, which BLAS streams faster than a sum: on an Intel Xeon with 2 threads,
    a 1B fp32 decode in ONNX Runtime read 31.6 GB/s where a sum's median read 30.2, a bound below the rate; the
    product read 32-36 GB/s.

    On the CPU the probe runs on `threads` threads (default: torch's, as they are). A bound for a decode must be read
    on the decode's own threads: one core alone streams less than two (on a 2-core EPYC, 27.4 GB/s on one thread,
    29.4 GB/s on two later the same day), and a bound read on one thread put a 2-thread 1B fp32 decode above it."""
    import torch

    def synchronize() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    matrix, vector = buffer.view(-1, 1024), torch.ones(1024, device=device)

    def seconds(read: Callable[[], Any]) -> float:
        start = time.perf_counter()
        read()
        synchronize()
        return time.perf_counter() - start

    reads = (buffer.sum, lambda: torch.mv(matrix, vector))
    rates = []
    with torch_threads(threads if torch.device(device).type == "cpu" else None):
        for read in reads:
            seconds(read)
        for _ in range(rounds):
            rates.append(buffer.numel() * 4 / min(seconds(read) for read in reads))
    return summary(rates)


def describe_machine(device: str, threads: int) -> dict[str, Any]:
    """The CPU's model, its cores (those this process may use) and the threads the benchmark ran on."""
    from ..training import describe_device

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "threads": threads, "torch": describe_device(device)}


def random_prompts(batch_size: int, prompt_tokens: int, vocab_size: int, device: str) -> dict:
    """`batch_size` prompts of `prompt_tokens` token ids drawn with a fixed seed (the same on every run)."""
    import torch

    generator = torch.Generator().manual_seed(PROMPT_SEED)
    input_ids = torch.randint(0, vocab_size, (batch_size, prompt_tokens), generator=generator)
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids).to(device)}


def time_generate(model: Any, prompts: dict, new_tokens: int, pad_token_id: int, device: str) -> float:
    """Seconds `generate` takes for exactly `new_tokens` greedy tokens per prompt (no early end of sequence)."""
    import torch

    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            **prompts,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def check_settings(batch_sizes: Sequence[int], prompt_tokens: int, new_tokens: int, rounds: int) -> None:
    """Raise a ValueError for settings that time nothing."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch sizes (--batch-sizes) must be at least 1, got {list(batch_sizes)}")
    if prompt_tokens < 1:
        raise ValueError(f"prompt tokens (--prompt-tokens) must be at least 1, got {prompt_tokens}")
    if new_tokens < 2:
        raise ValueError(
            f"new tokens (--new-tokens) must be at least 2 (the first is the prefill's, decode is the rest), got "
            f"{new_tokens}"
        )
    if rounds < 1:
        raise ValueError(f"rounds (--rounds) must be at least 1, got {rounds}")


def bench_folder(
    folder: "str | os.PathLike | LoadedFolder",
    batch_sizes: Sequence[int] = (1, 8),
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    rounds: int = 3,
    device: str = "cpu",
    threads: int | None = None,
    bandwidth_megabytes: int = 1024,
) -> BenchResult:
    """Benchmark a text-generation folder (a path, or a folder `vaswani.runtime.loading.load_folder` loaded): for each batch
    size, the time to the first token (`generate` of one token) and decode tokens/s (the other `new_tokens` - 1 tokens
    per prompt over the time they add), medians of `rounds` after a warm-up. `threads`: ONNX Runtime's intra-op
    threads (a PyTorch model runs on torch's threads, which this function leaves as they are). The bandwidth probe
    reads on the threads the decode computes on (`decode_threads`), whatever torch's own count."""
    from ..runtime.loading import LoadedFolder, load_folder

    check_settings(batch_sizes, prompt_tokens, new_tokens, rounds)
    loaded = folder if isinstance(folder, LoadedFolder) else load_folder(folder, device, threads, "text-generation")
    if loaded.task != "text-generation":
        raise ValueError(f"{loaded.folder} holds a {loaded.task!r} model; bench needs a text-generation one.")
    config = loaded.model.config
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and prompt_tokens + new_tokens > context:
        raise ValueError(
            f"{prompt_tokens} prompt + {new_tokens} new tokens pass the model's context of {context}: lower "
            "--prompt-tokens or --new-tokens."
        )
    tokenizer = loaded.tokenizer
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    weights = weight_bytes(loaded)
    used_threads = decode_threads(loaded)
    probe_threads = used_threads if device == "cpu" else None
    bandwidth = memory_bandwidth(device, bandwidth_megabytes, threads=probe_threads)
    bound = bandwidth / weights
    result = BenchResult(
        folder=str(loaded.folder),
        form=loaded.form,
        device=device,
        machine=describe_machine(device, used_threads),
        weight_bytes=weights,
        bandwidth_bytes_per_s=bandwidth,
        bound_tokens_per_s=bound,
        rounds=rounds,
        bandwidth_threads=probe_threads,
    )
    result.engine = runtime_name(loaded)
    for batch_size in batch_sizes:
        prompts = random_prompts(batch_size, prompt_tokens, config.vocab_size, device)
        first, whole = [], []
        time_generate(loaded.model, prompts, new_tokens, pad_token_id, device)  # warm-up: allocations, kernels
        for _ in range(rounds):
            first.append(time_generate(loaded.model, prompts, 1, pad_token_id, device))
            whole.append(time_generate(loaded.model, prompts, new_tokens, pad_token_id, device))
        first_s, whole_s = statistics.median(first), statistics.median(whole)
        decode_rate = batch_size * (new_tokens - 1) / max(whole_s - first_s, 1e-9)
        result.rows.append(
            BenchRow(
                batch_size=batch_size,
                prompt_tokens=prompt_tokens,
                new_tokens=new_tokens,
                generated_tokens=batch_size * new_tokens,
                time_to_first_token_s=first_s,
                decode_tokens_per_s=decode_rate,
                bound_fraction=decode_rate / batch_size / bound,
            )
        )
    return result
