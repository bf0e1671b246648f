"""Automatic prefix caching: the keys and values of prompt prefixes kept for later requests that start the same way
(a shared system prompt, the conversation so far on each turn of a chat), as vLLM's automatic prefix caching keeps
them.

A sequence's tokens are cut into blocks of `block_size`; a block is keyed by its tokens and its parent's key (so a
key names the whole prefix up to the block's end), and holds that block's keys and values as the runtime gives them
(`row_cache`): by default a copy of its slice of every cache tensor, (kv_heads, tokens, head_dim) each
(`CopiedBlocks`); a step model that keeps its cache in blocks of its own shares them instead (its `prefix_storage`:
the paged batch's `SharedBlocks`, which copy nothing). A sequence's last block may be partial (its tail, shorter
than `block_size`). A prompt's lookup walks its full blocks from the start and stops at the first one missing; there
it takes, of the blocks that follow the last one found, the one sharing the most leading tokens with the rest of the
prompt, to the token (SGLang's radix cache matches tokens so; vLLM's whole blocks only). So a prompt that parts from
a cached one inside a block, or a chat turn that resends the previous one's tail, reuses every token they share.
The prefix found is handed to the runtime's prefill (`StepModel.prefill_group`'s `prefixes`), which computes only
the rest. At least one prompt token is always computed: its logits choose the first token. Sequences are stored when
a prompt's prefill ends (so requests arriving while it decodes reuse it) and when a sequence leaves (its answer too:
the next turn of a chat resends it); a partial block that a longer one after the same parent begins with is dropped.

Blocks are evicted least recently used under a byte budget. A lookup or a store touches a prefix's blocks from its
last to its first, so that a parent is always younger than its children and the leaves go first: evicting a parent
would strand its children, which no lookup can reach without it.

A block's tokens and its parent's key are stored with it and compared on lookup: a hash collision is a miss, never
another prompt's keys. A block is read only up to the tokens a lookup matched: a partial block's row may go on
writing after its tail, never inside it.

    >>> cache = PrefixCache.for_model(step_model, max_bytes=1 << 30)
    >>> cached, prefix = cache.lookup(prompt)                 # tokens reused, and their cache arrays
    >>> group = step_model.prefill_group(rows, prompts, [prefix])
    >>> cache.store(prompt, lambda start, stop: group.row_cache(0, start, stop))
"""

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..runtime.decoders.portable import concat

log = logging.getLogger(__name__)

Array = Any  # numpy arrays on the CPU, torch tensors on a GPU

# vLLM's default block size: small enough that a prefix ending inside a block loses little, large enough that the
# per-block bookkeeping (a dictionary entry, one small array per cache tensor) stays negligible.
BLOCK_SIZE = 16
DEFAULT_MAX_BYTES = 1 << 30


class CopiedBlocks:
    """How the prefix cache keeps a block by default: a copy of its slice of each cache tensor, (kv_heads,
    block_size, head_dim) each, as the runtime's `row_cache` reads it out; a prefix is their concatenation.

    A step model may keep them its own way (its `prefix_storage`), with the same members: `block_size`, `nbytes(kept)`,
    `prefix(kept_blocks, tokens)` (what `prefill_group` takes) and `release(kept)` (the cache lets go of a block)."""

    def __init__(self, block_size: int = BLOCK_SIZE):
        self.block_size = block_size

    def nbytes(self, arrays: list[Array]) -> int:
        return sum(int(array.nbytes) for array in arrays)

    def prefix(self, blocks: list[list[Array]], tokens: int) -> list[Array]:
        return [concat([block[t] for block in blocks], axis=1)[:, :tokens] for t in range(len(blocks[0]))]

    def release(self, arrays: list[Array]) -> None:
        pass


@dataclass
class Block:
    parent: int  # the key of the block before it (0 for the first): checked on lookup with the tokens
    tokens: tuple[int, ...]
    kept: Any  # the block's keys and values as the cache's `storage` keeps them
    nbytes: int


class PrefixCache:
    """The keys and values of prompt prefixes, in blocks of `block_size` tokens, at most `max_bytes` of them.

    Args:
        max_bytes: the budget; the least recently used blocks are evicted past it (0 stores nothing).
        block_size: tokens per block (where `storage` is not given).
        storage: how blocks are kept (`CopiedBlocks` by default; `for_model` takes the step model's own).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, block_size: int = BLOCK_SIZE, storage: Any = None):
        if max_bytes < 0 or block_size < 1:
            raise ValueError("The prefix cache needs max_bytes >= 0 and block_size >= 1.")
        self.storage = storage if storage is not None else CopiedBlocks(block_size)
        self.max_bytes, self.block_size = max_bytes, self.storage.block_size
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # oldest first
        # (a key, a token) -> the keys of the blocks after that key starting with that token
        self.children: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
        self.bytes = 0
        # Token counts for /metrics: looked up, found (the hit rate is their ratio), and blocks evicted so far.
        self.queried_tokens = self.hit_tokens = self.evicted_blocks = 0

    @classmethod
    def for_model(cls, model: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> "PrefixCache":
        """A prefix cache for `model`'s batches: sharing its blocks where it keeps its cache in blocks of its own
        (`prefix_storage`: the paged batch of `engine="openvino"`), else copying them."""
        return cls(max_bytes, storage=getattr(model, "prefix_storage", None))

    def keys(self, tokens: Sequence[int]) -> list[tuple[int, int, tuple[int, ...]]]:
        """The key, parent key and tokens of each full block of `tokens`, in order."""
        keys, parent = [], 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = tuple(tokens[start : start + self.block_size])
            key = hash((parent, block))
            keys.append((key, parent, block))
            parent = key
        return keys

    def lookup(self, prompt: Sequence[int]) -> tuple[int, Any]:
        """The longest cached prefix of `prompt` that leaves at least its last token to compute: how many tokens, and
        their cache as `prefill_group` takes it (by default (kv_heads, tokens, head_dim) per cache tensor; None when
        nothing is cached)."""
        found: list[tuple[int, Block]] = []
        parent = 0
        for key, parent_key, tokens in self.keys(prompt):
            block = self.blocks.get(key)
            if block is None or block.parent != parent_key or block.tokens != tokens:  # a missing block, or a collision
                break
            found.append((key, block))
            parent = key
        matched = len(found) * self.block_size
        # Where the full blocks end: the block after them sharing the most leading tokens with the rest of the prompt.
        rest = tuple(prompt[matched : matched + self.block_size])
        after = self.children.get((parent, rest[0]), ()) if rest else ()
        shared, key = max(((common_length(self.blocks[key].tokens, rest), key) for key in after), default=(0, None))
        if shared:
            found.append((key, self.blocks[key]))
            matched += shared
        for key, _ in reversed(found):  # the last block first: parents stay younger than their children
            self.blocks.move_to_end(key)
        cached = min(matched, len(prompt) - 1)
        self.queried_tokens += len(prompt)
        self.hit_tokens += cached
        if cached <= 0:
            return 0, None
        used = -(-cached // self.block_size)  # the blocks holding the cached tokens
        return cached, self.storage.prefix([block.kept for _, block in found[:used]], cached)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether the block that ends `tokens` (a multiple of `block_size` long) is cached, without touching it."""
        keys = self.keys(tokens)
        if not keys or len(tokens) % self.block_size:
            raise ValueError(f"holds() takes whole blocks of {self.block_size} tokens, not {len(tokens)}.")
        key, parent, block_tokens = keys[-1]
        block = self.blocks.get(key)
        return block is not None and block.parent == parent and block.tokens == block_tokens

    def store(self, tokens: Sequence[int], read: Callable[[int, int], Any]) -> int:
        """Keep the blocks of `tokens` not cached yet, its partial last block too; `read(start, stop)` gives the cache
        of tokens [start, stop) as the cache keeps it (the runtime's `row_cache`: by default a copy, (kv_heads,
        stop - start, head_dim) per cache tensor). Room is made by evicting other prefixes' blocks, least recently
        used first; where that is not enough, the deepest blocks of `tokens` are not kept (a prefix is only reachable
        through its first blocks). Returns the blocks added."""
        if self.max_bytes == 0:
            return 0
        chain = self.keys(tokens)
        whole = len(chain) * self.block_size
        if whole < len(tokens):
            parent = chain[-1][0] if chain else 0
            tail = tuple(tokens[whole:])
            chain.append((hash((parent, tail)), parent, tail))
        own = {key for key, _, _ in chain}
        added = 0
        for index, (key, parent, block_tokens) in enumerate(chain):
            if key in self.blocks:  # this prefix's, or a colliding one's, which is kept: its tokens tell them apart
                continue
            if len(block_tokens) < self.block_size and self.begins_a_cached_block(parent, block_tokens):
                break  # a partial block: the cached one it begins serves it
            start = index * self.block_size
            kept = read(start, start + len(block_tokens))
            nbytes = self.storage.nbytes(kept)
            if not self.make_room(nbytes, own):
                self.storage.release(kept)
                break
            self.drop_partial_prefixes(parent, block_tokens)
            self.blocks[key] = Block(parent, block_tokens, kept, nbytes)
            self.children[parent, block_tokens[0]].add(key)
            self.bytes += nbytes
            added += 1
        for key, _, _ in reversed(chain):  # the last block first: parents stay younger than their children
            if key in self.blocks:
                self.blocks.move_to_end(key)
        return added

    def begins_a_cached_block(self, parent: int, tokens: tuple[int, ...]) -> bool:
        """Whether a cached block after `parent` begins with `tokens` (a full block with the same tokens has the same
        key, so only a partial block's check can find one)."""
        after = self.children.get((parent, tokens[0]), ())
        return any(self.blocks[key].tokens[: len(tokens)] == tokens for key in after)

    def drop_partial_prefixes(self, parent: int, tokens: tuple[int, ...]) -> None:
        """Drop the partial blocks after `parent` that a block of `tokens` begins with: it serves every lookup they
        would."""
        for key in list(self.children.get((parent, tokens[0]), ())):
            block = self.blocks[key]
            if len(block.tokens) < len(tokens) and tokens[: len(block.tokens)] == block.tokens:
                self.evict(key)

    def make_room(self, nbytes: int, keep: set[int]) -> bool:
        """Evict the least recently used blocks outside `keep` until `nbytes` more fit; False where they cannot."""
        while self.bytes + nbytes > self.max_bytes:
            oldest = next((key for key in self.blocks if key not in keep), None)
            if oldest is None:
                return False
            self.evict(oldest)
            self.evicted_blocks += 1
        return True

    def evict(self, key: int) -> None:
        """Let go of block `key`."""
        block = self.blocks.pop(key)
        siblings = self.children[block.parent, block.tokens[0]]
        siblings.discard(key)
        if not siblings:
            del self.children[block.parent, block.tokens[0]]
        self.storage.release(block.kept)
        self.bytes -= block.nbytes

    def stats(self) -> dict[str, int]:
        """For /health: blocks and bytes held, tokens looked up and found."""
        return {
            "blocks": len(self.blocks),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
        }


def common_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens `first` and `second` share."""
    for index, (a, b) in enumerate(zip(first, second)):
        if a != b:
            return index
    return min(len(first), len(second))
