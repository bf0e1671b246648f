"""The server's batch for `engine="openvino"`: a paged KV cache inside OpenVINO, as OpenVINO GenAI's continuous
batching and vLLM keep theirs.

The portable graph is compiled in its paged form (`openvino_forms.make_paged`): the tokens of every sequence of a
call go in one flat row, and each sequence's keys and values live in fixed-size blocks of shared cache tensors
(`BlockPool`), which OpenVINO's paged-attention kernel reads and appends to in place. So rows of any lengths
prefill and decode side by side without padding, a row joins or leaves the running batch without a copy of anyone's
cache, and the server's prefix cache keeps blocks of the pool itself (`SharedBlocks`): a prompt whose first tokens
it holds starts from those very blocks, shared by reference.
The stateful batch it replaces (`openvino.OpenVinoBatch`, still used for graphs the paged form cannot take: ALiBi)
read the whole batch's cache out of OpenVINO and wrote it back at every join and leave.

    >>> step = PagedStepModel(model, model.decoder_runtime)      # an engine="openvino" OrtModelForCausalLM
    >>> group = step.prefill_group(rows, prompts)
    >>> logits = group.run(group.columns)                        # (rows, vocab): each prompt's last token
    >>> batch = step.new_batch(); batch.join(group, [0, 1]); batch.step(tokens)
"""

import copy
import logging
import math
import weakref
from typing import Any

import numpy as np

from ..openvino import OPENVINO_TYPES, import_openvino
from ..openvino_forms import make_paged
from .portable import context_length

logger = logging.getLogger(__name__)

# `kv_cache_dtype` (vLLM's name) -> OpenVINO's KV_CACHE_PRECISION, by compute precision: OpenVINO's paged-attention
# kernel takes only some cache types at each (OpenVINO 2026.4's CPU plugin: f32 or f16 at f32 compute; bf16 at bf16
# compute, where an f32 cache fails to compile and an f16 one is read back as asked but its inputs come out bf16).
# "auto" is the 16-bit type: it halves the bytes a decoding step reads of the cache (a 16-row step at 200 tokens of
# SmolLM2-135M int8 at f32 compute: 34 against 41 ms) and measured no loss at f32 compute
# (docs/results/kv_cache_quality_{fp32,int8}_avx512.md: perplexity as the server decodes, against a float32 cache,
# +0.0% on the fp32 export and +0.1% pooled on int8, tuning and held-out texts alike).
# OpenVINO's own default, u8, stores scales inside blocks, which the prefix cache's token ranges cannot cut: not
# offered.
KV_CACHE_TYPES = {
    "f32": {"auto": "f16", "float16": "f16", "float32": "f32"},
    "bf16": {"auto": "bf16", "bfloat16": "bf16"},
}
KV_CACHE_DTYPES = tuple(dict.fromkeys(name for taken in KV_CACHE_TYPES.values() for name in taken))
# The pool's numpy arrays by cache type; numpy has no bfloat16, so its blocks are held as their 16 bits
# (`BlockPool.grow` hands them to OpenVINO as bf16).
CACHE_ARRAYS = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Raise a ValueError naming the choices for a `kv_cache_dtype` not in `KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {list(KV_CACHE_DTYPES)}.")


def kv_cache_type(kv_cache_dtype: str, precision: str) -> str:
    """OpenVINO's type for the paged cache asked for as `kv_cache_dtype` at compute `precision` ("f32" or "bf16"); a
    ValueError naming the choices where the paged-attention kernel takes no such cache at that precision.

        >>> kv_cache_type("auto", "f32"), kv_cache_type("auto", "bf16")
        ('f16', 'bf16')
    """
    check_kv_cache_dtype(kv_cache_dtype)
    types = KV_CACHE_TYPES[precision]
    if kv_cache_dtype not in types:
        other = next(compute for compute, taken in KV_CACHE_TYPES.items() if kv_cache_dtype in taken)
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not available at OpenVINO's {precision} compute, whose paged "
            f"attention takes {', '.join(repr(name) for name in types)}; use one of those, or compute in {other} "
            f"(openvino_precision={other!r}, `vaswani serve --openvino-precision {other}`) for a {kv_cache_dtype} "
            "cache."
        )
    return types[kv_cache_dtype]


# The pool's first size, in bytes of cache reserved rather than used: numpy's zeroed arrays of this size are mapped
# lazily, so a block's memory is committed when it is first written (8 GiB reserved cost no memory and no time to
# start, and left a decoding step's time unchanged, on SmolLM2-135M). A full pool doubles, copying the cache: 0.5 s at
# 360 MiB on a 2-core Xeon, every stream stalled meanwhile, and the prefix cache, holding blocks of the pool, would
# make it grow again and again from a small start. At most MOST_FIRST_BLOCKS (half a million tokens: a small model's
# blocks are small). Where the reservation is refused (strict overcommit), the pool starts at FIRST_BLOCKS.
FIRST_POOL_BYTES = 8 << 30
MOST_FIRST_BLOCKS = 1 << 14
FIRST_BLOCKS = 64


class BlockPool:
    """The cache tensors of the paged graph, (blocks, kv_heads, block_size, head_dim) each, bound to its infer request
    by shared memory, and which of their blocks are free."""

    def __init__(self, compiled: Any, request: Any, names: list[str]):
        self.request, self.names = request, names
        port = compiled.input(names[0])
        # The type the cache was compiled in, which the plugin may choose otherwise than it was asked.
        self.element_type = port.get_element_type()
        self.cache_type = self.element_type.get_type_name()
        if self.cache_type not in CACHE_ARRAYS:
            raise ValueError(f"OpenVINO compiled the paged KV cache in {self.cache_type}, which the pool cannot hold.")
        self.dtype = np.dtype(CACHE_ARRAYS[self.cache_type])
        shape = port.get_partial_shape()
        self.heads, self.block_size, self.head_dim = (shape[axis].get_length() for axis in (1, 2, 3))
        self.arrays: list[np.ndarray] = []
        self.free: list[int] = []
        # Holders of each block: the rows whose cache it is and the prefix cache (`SharedBlocks`); free at 0.
        self.references: list[int] = []
        reserved = max(FIRST_BLOCKS, min(FIRST_POOL_BYTES // self.bytes_per_block, MOST_FIRST_BLOCKS))
        try:
            self.grow(reserved)
        except MemoryError:
            logger.info("paged KV cache: %d blocks could not be reserved; starting at %d", reserved, FIRST_BLOCKS)
            self.grow(FIRST_BLOCKS)

    @property
    def blocks(self) -> int:
        return self.arrays[0].shape[0] if self.arrays else 0

    @property
    def bytes_per_block(self) -> int:
        return len(self.names) * self.heads * self.block_size * self.head_dim * np.dtype(self.dtype).itemsize

    def grow(self, blocks: int) -> None:
        """Make room for `blocks` blocks in all (the blocks held keep their numbers and contents)."""
        openvino = import_openvino()
        old = self.blocks
        shape = (blocks, self.heads, self.block_size, self.head_dim)
        arrays = []
        for index, name in enumerate(self.names):
            array = np.zeros(shape, dtype=self.dtype)
            if old:
                array[:old] = self.arrays[index]
            tensor = openvino.Tensor(array, openvino.Shape(shape), self.element_type)  # shares `array`
            self.request.set_tensor(name, tensor)
            arrays.append(array)
        self.arrays = arrays
        self.references.extend([0] * (blocks - old))
        self.free.extend(range(blocks - 1, old - 1, -1))  # popped from the end: the lowest first
        if old:
            logger.info("paged KV cache grown to %d blocks (%.0f MiB)", blocks, blocks * self.bytes_per_block / 2**20)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks, held once each."""
        if count > len(self.free):
            self.grow(max(2 * self.blocks, self.blocks + count - len(self.free)))
        blocks = [self.free.pop() for _ in range(count)]
        for block in blocks:
            self.references[block] = 1
        return blocks

    def share(self, block: int) -> int:
        """Hold `block` once more (a row starting from it, the prefix cache keeping it); returns it."""
        if self.references[block] < 1:
            raise ValueError(f"block {block} is free; only a held block can be shared.")
        self.references[block] += 1
        return block

    def release(self, blocks: list[int]) -> None:
        """Let go of `blocks` once each (and empty the list); a block no one holds any more is free."""
        for block in blocks:
            self.references[block] -= 1
            if self.references[block] == 0:
                self.free.append(block)
        blocks.clear()


class PagedRow:
    """One sequence's cache: the blocks it holds, in order, and how many tokens they hold. Its blocks go back to the
    pool when it is released or dropped (a prefill that failed, a batch that was thrown away)."""

    def __init__(self, pool: BlockPool):
        self.pool, self.blocks, self.length = pool, [], 0
        self.release = weakref.finalize(self, pool.release, self.blocks)

    def reserve(self, tokens: int) -> None:
        """Hold blocks for `tokens` tokens in all."""
        missing = math.ceil(tokens / self.pool.block_size) - len(self.blocks)
        if missing > 0:
            self.blocks.extend(self.pool.allocate(missing))

    def adopt(self, prefix: "SharedPrefix") -> None:
        """Start the row with a cached prefix: its whole blocks shared, not copied. A block the prefix ends inside is
        copied into one of the row's own, which the row goes on writing."""
        size = self.pool.block_size
        whole = prefix.tokens // size
        self.blocks.extend(self.pool.share(block) for block in prefix.blocks[:whole])
        if prefix.tokens % size:
            (own,) = self.pool.allocate(1)
            for array in self.pool.arrays:
                array[own] = array[prefix.blocks[whole]]
            self.blocks.append(own)
        self.length = prefix.tokens

    def share(self, start: int, stop: int) -> int:
        """The block holding tokens [start, stop), held once more for the prefix cache: a whole block of the row's,
        or the block its last tokens are in (their prefix, [start, length) or less, which the row never writes again:
        it only appends)."""
        size = self.pool.block_size
        if start % size or not 0 < stop - start <= size or stop > self.length:
            raise ValueError(
                f"the row shares the tokens of one of its blocks of {size}, from the block's start, among the "
                f"{self.length} it holds; not tokens [{start}, {stop})."
            )
        return self.pool.share(self.blocks[start // size])


class SharedPrefix:
    """A cached prefix of `tokens` tokens in the pool's blocks (the first `ceil(tokens / block_size)` of `blocks`),
    held while this object lives: what `SharedBlocks.prefix` gives a prompt's prefill to adopt."""

    def __init__(self, pool: BlockPool, blocks: list[int], tokens: int):
        self.blocks = [pool.share(block) for block in blocks[: math.ceil(tokens / pool.block_size)]]
        self.tokens = tokens
        weakref.finalize(self, pool.release, list(self.blocks))


class SharedBlocks:
    """How the server's prefix cache keeps the paged batch's blocks (its `storage`, see `serving/prefix_cache.py`):
    by reference, not by copy. A block the cache keeps is one of the pool's, held by the cache as by each row
    starting from it, free once none holds it; so storing a prompt's blocks and starting a later prompt from them
    copy nothing (but the block a prefix ends inside), and the cache's bytes are pool blocks. Blocks are the
    pool's size (32 tokens for OpenVINO's CPU kernel)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def nbytes(self, block: int) -> int:
        return self.pool.bytes_per_block

    def prefix(self, blocks: list[int], tokens: int) -> SharedPrefix:
        return SharedPrefix(self.pool, blocks, tokens)

    def release(self, block: int) -> None:
        self.pool.release([block])


class NotPageable(ValueError):
    """The graph does not take the paged form (`make_paged` refused it): `OpenVinoRuntime.step_model` falls back to
    the stateful batch for it. Nothing else does: any other failure to build the paged batch is raised as it is."""


class PagedStepModel:
    """The server's step model of `engine="openvino"`: prompts and decode steps in the paged graph (see the module's
    docstring). Built where `make_paged` takes the graph (else `NotPageable`); `OpenVinoRuntime.step_model` falls back
    to the stateful batch elsewhere, and says why in the log."""

    def __init__(self, model: Any, runtime: Any, kv_cache_dtype: str = "auto", int8_activations: bool = True):
        decoder = runtime.openvino
        cache_type = kv_cache_type(kv_cache_dtype, decoder.precision)
        self.vocab_size = model.manifest["vocab_size"]
        self.context_length = context_length(model.config)
        graph = decoder.read_copy()
        self.weights = decoder.weights  # the data file's mapping the graph's quantized weights read from
        try:
            make_paged(graph, model.manifest)
        except (ValueError, RuntimeError) as error:  # OpenVINO's own transformation raises a RuntimeError
            raise NotPageable(str(error)) from error
        logger.info("paged KV cache in %s (kv_cache_dtype=%s)", cache_type, kv_cache_dtype)
        properties = {
            "INFERENCE_PRECISION_HINT": OPENVINO_TYPES[decoder.precision],
            "INFERENCE_NUM_THREADS": int(decoder.threads),
            "KV_CACHE_PRECISION": cache_type,
        }
        if not int8_activations:
            # The CPU plugin quantizes the activations of int8/int4 weights' products to int8 in calls of several
            # tokens (prompts, steps of several rows, speculative verification) but not in a one-row step, so a
            # sequence's tokens can depend on the rows it shares steps with. Float activations everywhere make every
            # call compute alike, at the cost of slower prompts.
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 0
            logger.info("paged batch: float activations in every call (int8_activations=False)")
        try:
            self.compiled = decoder.core.compile_model(graph, "CPU", properties)
        except RuntimeError as error:  # e.g. "bf16" forced on a CPU whose plugin then computes in f32
            raise RuntimeError(
                f"OpenVINO could not compile the paged graph at {decoder.precision} compute with its KV cache in "
                f"{cache_type}; where the CPU lacks bfloat16, serve with --openvino-precision f32. {error}"
            ) from error
        self.request = self.compiled.create_infer_request()
        names = [port.get_any_name() for port in self.compiled.inputs if "_cache." in port.get_any_name()]
        self.pool = BlockPool(self.compiled, self.request, names)
        if self.pool.cache_type != cache_type:
            logger.warning("OpenVINO keeps the paged KV cache in %s, not %s as asked", self.pool.cache_type, cache_type)
        # What runs where, as `vaswani serve` prints it at start (the runtime's own line is offline `generate`'s).
        activations = "" if int8_activations else ", float activations"
        self.description = (
            f"every call in OpenVINO's paged graph ({decoder.precision}{activations}), the KV cache in "
            f"{self.pool.cache_type} blocks"
        )
        self.prefix_storage = SharedBlocks(self.pool)
        self.logits_port = self.compiled.output("logits")

    def new_batch(self) -> "PagedBatch":
        return PagedBatch(self)

    def prefill_group(
        self, rows: list[Any], prompts: list[list[int]], prefixes: list[SharedPrefix | None] | None = None
    ) -> "PagedPrefill":
        return PagedPrefill(self, rows, prompts, prefixes)

    def new_row(self) -> PagedRow:
        return PagedRow(self.pool)

    def infer(self, rows: list[PagedRow], tokens: list[np.ndarray], every_position: bool = False) -> np.ndarray:
        """Feed `tokens[i]` (at least one) after the cache of `rows[i]`, in one call; the rows grow by them. Returns
        the logits of each row's last token (rows, vocab), or with `every_position` of every token fed (tokens,
        vocab, the rows' in order)."""
        counts = np.array([len(fed) for fed in tokens], dtype=np.int32)
        for row, count in zip(rows, counts):
            row.reserve(row.length + int(count))
        past = np.array([row.length for row in rows], dtype=np.int32)
        begins = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        blocks = [
            row.blocks[: math.ceil((row.length + count) / self.pool.block_size)] for row, count in zip(rows, counts)
        ]
        feeds = {
            "input_ids": np.concatenate(tokens).astype(np.int64),
            "position_ids": np.concatenate([np.arange(p, p + c) for p, c in zip(past, counts)]).astype(np.int64),
            "logits_positions": (np.arange(begins[-1]) if every_position else begins[1:] - 1).astype(np.int64),
            "past_lens": past,
            "subsequence_begins": begins,
            "block_indices": np.concatenate(blocks).astype(np.int32),
            "block_indices_begins": np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int32),
            "max_context_len": np.array(int((past + counts).max()), dtype=np.int32),
        }
        self.request.infer(feeds, share_inputs=True)
        for row, count in zip(rows, counts):
            row.length += int(count)
        return self.request.get_tensor(self.logits_port).data[:, -1].copy()


class PagedPrefill:
    """Prompts prefilled together (the `Prefill` protocol) in the paged graph. Nothing is padded, so a call feeds any
    number of tokens (`run(columns)`: up to `columns` x rows; the scheduler's fused step: what its token budget
    leaves, `PagedBatch.step_with_prefill`): each prompt's rest (after any cached prefix) in order, a prompt finished
    before the next begins. Prompts arriving meanwhile join the group (`extend`), and the prompts already in leave
    it (`take_finished`) to join the running batch while the others go on."""

    def __init__(
        self,
        model: PagedStepModel,
        rows: list[Any],
        prompts: list[list[int]],
        prefixes: list[SharedPrefix | None] | None = None,
    ):
        self.model = model
        self.rows: list[Any] = []
        self.states: list[PagedRow] = []
        self.rests: list[np.ndarray] = []  # each prompt's tokens after its cached prefix
        self.fed: list[int] = []  # tokens of each rest fed so far
        self.last_logits: list[np.ndarray | None] = []
        self.extend(rows, prompts, prefixes)

    def extend(self, rows: list[Any], prompts: list[list[int]], prefixes: list[SharedPrefix | None] | None = None):
        """Take more prompts into the group while it runs, after the ones in it: nothing is padded, so a prompt that
        arrives mid-prefill is fed from the next call on (the scheduler's `_extend_group`)."""
        for row, prompt, prefix in zip(rows, prompts, prefixes or [None] * len(prompts)):
            state = self.model.new_row()
            if prefix is not None:
                state.adopt(prefix)
            state.reserve(len(prompt))
            self.rows.append(row)
            self.states.append(state)
            self.rests.append(np.asarray(prompt[state.length :], dtype=np.int64))
            self.fed.append(0)
            self.last_logits.append(None)

    @property
    def columns(self) -> int:
        return max(len(rest) for rest in self.rests)

    @property
    def tokens(self) -> int:
        return sum(len(rest) for rest in self.rests)

    @property
    def computed(self) -> int:
        return sum(self.fed)

    @property
    def done(self) -> bool:
        return self.computed == self.tokens

    def run(self, columns: int) -> np.ndarray:
        """Feed up to `columns` x rows tokens; returns every row's last prompt token's logits (rows, vocab) once
        `done`, else the logits of the rows fed."""
        rows, chunks = self.next_chunk(columns * len(self.rests))
        return self.fed_chunk(rows, chunks, self.model.infer([self.states[row] for row in rows], chunks))

    def next_chunk(self, tokens: int) -> tuple[list[int], list[np.ndarray]]:
        """The rows fed next (indices) and their tokens: up to `tokens` in all, the prompts in order."""
        budget, rows, chunks = tokens, [], []
        for row, (rest, fed) in enumerate(zip(self.rests, self.fed)):
            chunk = rest[fed : fed + budget]
            if len(chunk):
                rows.append(row)
                chunks.append(chunk)
                budget -= len(chunk)
        return rows, chunks

    def fed_chunk(self, rows: list[int], chunks: list[np.ndarray], logits: np.ndarray) -> np.ndarray:
        """Count a chunk `next_chunk` gave as fed, `logits` its rows' last tokens'; returns what `run` returns."""
        for row, chunk, row_logits in zip(rows, chunks, logits):
            self.fed[row] += len(chunk)
            if self.fed[row] == len(self.rests[row]):
                self.last_logits[row] = row_logits
        return np.stack(self.last_logits) if self.done else logits

    def take_finished(self) -> tuple["PagedPrefill", np.ndarray] | None:
        """The prompts already in while others are not, moved to a group of their own (done), with their last
        tokens' logits (rows, vocab): so that each prompt joins the running batch, and its first token is sampled,
        when its own prefill ends rather than the whole group's, as OpenVINO GenAI's and vLLM's schedulers do (16
        prompts arriving at once would otherwise all wait for the last). None where no prompt or every one is in."""
        finished = [row for row, logits in enumerate(self.last_logits) if logits is not None]
        if not finished or len(finished) == len(self.rests):
            return None
        part = copy.copy(self)
        for name in ("rows", "states", "rests", "fed", "last_logits"):
            values = getattr(self, name)
            setattr(part, name, [values[row] for row in finished])
            setattr(self, name, [value for row, value in enumerate(values) if row not in finished])
        return part, np.stack(part.last_logits)

    def keep(self, rows: list[int]) -> tuple[list[Any], list[PagedRow]]:
        """The rows listed with their caches, to join a `PagedBatch`; the others' blocks go back to the pool."""
        for index, state in enumerate(self.states):
            if index not in rows:
                state.release()
        return [self.rows[i] for i in rows], [self.states[i] for i in rows]

    def row_cache(self, row: int, start: int, stop: int) -> int:
        return self.states[row].share(start, stop)


class PagedBatch:
    """The running sequences (the `Batch` protocol), each with its own blocks: a join adds rows, a leave releases
    their blocks, and neither copies a cache."""

    def __init__(self, model: PagedStepModel):
        self.model = model
        self.rows: list[Any] = []
        self.states: list[PagedRow] = []

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, group: PagedPrefill, keep: list[int]) -> None:
        rows, states = group.keep(keep)
        self.rows += rows
        self.states += states

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,)); returns the logits (batch, vocab)."""
        return self.model.infer(self.states, list(np.asarray(tokens, dtype=np.int64).reshape(-1, 1)))

    def step_with_prefill(
        self, tokens: np.ndarray, group: PagedPrefill, prompt_tokens: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """`step(tokens)` and the group's next `prompt_tokens` prompt tokens (fewer where its prompts hold fewer) in
        one call of the graph, which reads the weights once for both; returns both logits: (batch, vocab) and the
        group's as `PagedPrefill.run` returns them. `tokens` may be empty (no row running yet): then the call is the
        group's alone. The scheduler fills its whole token budget so: besides doing more per call, a call of 256
        tokens computes sooner than one of 254 on an AMX CPU at bf16 compute, where a call's time steps up just past
        each multiple of 64 tokens (SmolLM2-135M int8, 2 threads: 57 against 75 ms; 64 tokens 24 ms, 65 34 ms;
        docs/results/paged_call_sizes_amx.md)."""
        rows, chunks = group.next_chunk(prompt_tokens)
        steps = list(np.asarray(tokens, dtype=np.int64).reshape(-1, 1))
        logits = self.model.infer(self.states + [group.states[row] for row in rows], steps + chunks)
        return logits[: len(self.rows)], group.fed_chunk(rows, chunks, logits[len(self.rows) :])

    def verify(self, fed: list[list[int]]) -> np.ndarray:
        """Feed each row its last token and proposals in one call; the logits of every fed position (rows, longest,
        vocab), a row's columns past its own count zero."""
        logits = self.model.infer(self.states, [np.asarray(tokens, dtype=np.int64) for tokens in fed], True)
        result = np.zeros((len(fed), max(len(tokens) for tokens in fed), logits.shape[-1]), dtype=logits.dtype)
        begin = 0
        for row, tokens in enumerate(fed):
            result[row, : len(tokens)] = logits[begin : begin + len(tokens)]
            begin += len(tokens)
        return result

    def rollback(self, rejected: list[int]) -> None:
        """Forget each row's last `rejected[i]` tokens: the next ones overwrite them in the row's blocks."""
        for state, count in zip(self.states, rejected):
            state.length -= count

    def keep(self, rows: list[int]) -> None:
        """Keep only the rows listed (in that order); the others' blocks go back to the pool."""
        for index, state in enumerate(self.states):
            if index not in rows:
                state.release()
        self.rows = [self.rows[i] for i in rows]
        self.states = [self.states[i] for i in rows]

    def row_cache(self, row: int, start: int, stop: int) -> int:
        return self.states[row].share(start, stop)
