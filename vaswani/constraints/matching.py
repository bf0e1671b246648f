"""Grammars compiled against a vocabulary, and the per-answer matchers that mask the logits token by token.

Three costs, paid at three different times:
- once per tokenizer: llguidance's view of the vocabulary (every token's bytes in a trie; a few hundred milliseconds
  for a 49k vocabulary), `grammar_vocabulary`, cached;
- once per grammar: its compilation against that vocabulary (`compile_grammar`, an LRU cache keyed by the grammar's
  text, so a schema that every request repeats is compiled once);
- once per token: the mask of the tokens the grammar allows next (tens of microseconds; `fill_masks` computes a
  batch's masks on llguidance's own threads, without the GIL, so the server runs it beside the model's step).

    >>> vocabulary = grammar_vocabulary(tokenizer, vocab_size=model.config.vocab_size, end_ids=[tokenizer.eos_token_id])
    >>> matcher = compile_grammar(Grammar.json_object(), vocabulary).matcher()
    >>> scores = matcher.mask_scores(scores)        # disallowed tokens -> -inf
    >>> matcher.accept(token)                        # then the next token's mask
    >>> matcher.finished                             # the grammar allows nothing more
"""

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .grammars import Grammar, require_llguidance

log = logging.getLogger(__name__)

# Compiled grammars kept per vocabulary: a server's clients repeat a handful of schemas, and one compiled grammar
# holds a few hundred kilobytes at most.
COMPILED_GRAMMARS_KEPT = 256


@dataclass(eq=False)
class GrammarVocabulary:
    """llguidance's view of a tokenizer's vocabulary, `size` ids wide (the model's logits, which may be wider than
    the tokenizer: ids past it are never allowed), with the ids that end an answer (`end_ids`: allowed once the
    grammar is complete)."""

    tokenizer: Any  # llguidance.LLTokenizer
    size: int
    end_ids: tuple[int, ...]
    compiled: OrderedDict = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def mask_words(self) -> int:
        return (self.size + 31) // 32


VOCABULARIES: dict[tuple[int, int, tuple[int, ...]], tuple[Any, GrammarVocabulary]] = {}
VOCABULARIES_LOCK = threading.Lock()


def grammar_vocabulary(tokenizer: Any, vocab_size: int | None = None, end_ids: Iterable[int] = ()) -> GrammarVocabulary:
    """The vocabulary of `tokenizer` (a transformers fast tokenizer) as grammars need it, built once per tokenizer,
    size and end ids. `vocab_size`: the width of the model's logits (default: the tokenizer's length); `end_ids`: the
    ids that end an answer (default: the tokenizer's end-of-sequence)."""
    require_llguidance()
    from llguidance.hf import from_tokenizer

    size = vocab_size or len(tokenizer)
    ends = tuple(sorted(set(end_ids))) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    if not ends:
        raise ValueError("Constrained decoding needs the ids that end an answer: the tokenizer has no eos_token.")
    if any(not 0 <= end < size for end in ends):
        raise ValueError(f"The end ids {list(ends)} are outside the vocabulary of {size} ids.")
    key = (id(tokenizer), size, ends)
    with VOCABULARIES_LOCK:
        held = VOCABULARIES.get(key)
        if held is not None and held[0] is tokenizer:
            return held[1]
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"Constrained decoding needs a fast (tokenizers) tokenizer; {type(tokenizer).__name__} is not one. "
                "Save the folder's tokenizer with transformers 5 (it converts slow tokenizers) and reload it."
            )
        start = time.perf_counter()
        ll_tokenizer = from_tokenizer(tokenizer, n_vocab=size, eos_token=list(ends))
        log.info("built the grammar vocabulary (%d ids) in %.0f ms", size, 1e3 * (time.perf_counter() - start))
        vocabulary = GrammarVocabulary(ll_tokenizer, size, ends)
        VOCABULARIES[key] = (tokenizer, vocabulary)  # the tokenizer is held so that its id is not reused
        return vocabulary


class CompiledGrammar:
    """A grammar compiled against a vocabulary; `matcher()` gives each answer its own matcher (a copy of a pristine
    one, so a repeated grammar is not compiled again)."""

    def __init__(self, grammar: Grammar, vocabulary: GrammarVocabulary, pristine: Any):
        self.grammar, self.vocabulary, self.pristine = grammar, vocabulary, pristine

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.pristine.deep_copy(), self.vocabulary)


def compile_grammar(grammar: Grammar, vocabulary: GrammarVocabulary) -> CompiledGrammar:
    """`grammar` compiled for `vocabulary`, from its cache when the same grammar was compiled before. A grammar that
    cannot be enforced (an unsupported JSON schema keyword, a grammar that does not parse) raises a ValueError that
    names the problem."""
    llguidance = require_llguidance()
    with vocabulary.lock:
        if grammar in vocabulary.compiled:
            vocabulary.compiled.move_to_end(grammar)
            return vocabulary.compiled[grammar]
    text = grammar.llguidance_grammar()
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, vocabulary.tokenizer)
    if failed:
        raise ValueError(f"The {grammar.describe()} cannot be enforced: {messages[0]}")
    pristine = llguidance.LLMatcher(vocabulary.tokenizer, text, log_level=0)
    if pristine.is_error():
        raise ValueError(f"The {grammar.describe()} cannot be enforced: {pristine.get_error()}")
    for warning in messages:
        log.warning("%s: %s", grammar.describe(), warning)
    compiled = CompiledGrammar(grammar, vocabulary, pristine)
    with vocabulary.lock:
        vocabulary.compiled[grammar] = compiled
        while len(vocabulary.compiled) > COMPILED_GRAMMARS_KEPT:
            vocabulary.compiled.popitem(last=False)
    return compiled


class GrammarMatcher:
    """One answer's progress through its grammar: which tokens it allows next (`mask_scores`), the tokens it took
    (`accept`), and whether it is complete (`finished`: nothing may follow but an end id)."""

    def __init__(self, matcher: Any, vocabulary: GrammarVocabulary):
        self.matcher, self.vocabulary = matcher, vocabulary
        # The next token's mask when `fill_masks` computed it ahead (beside the model's step), else None.
        self.next_mask: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        """Advance past `token`; a ValueError when the grammar does not allow it."""
        self.next_mask = None
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} does not fit the grammar: {self.matcher.get_error()}")

    def mask(self) -> np.ndarray:
        """The allowed-token bitmask (int32 words; bit t of the little-endian words is token t)."""
        if self.next_mask is None:
            fill_masks([self])
        return self.next_mask

    def mask_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` (1, vocab) or (vocab,), in place, with every token the grammar does not allow next set to -inf
        (the callers hold their own copy of the logits: a second vocabulary-wide copy per token is not needed)."""
        allowed = allowed_tokens(self.mask(), scores.shape[-1])
        return scores.masked_fill_(~allowed, -torch.inf)


def fill_masks(matchers: Sequence[GrammarMatcher]) -> None:
    """Compute every matcher's next-token mask (`GrammarMatcher.next_mask`) at once, on llguidance's threads (it
    releases the GIL, so a model step on another thread runs meanwhile)."""
    if not matchers:
        return
    words = matchers[0].vocabulary.mask_words
    masks = np.full((len(matchers), words), -1, dtype=np.int32)
    executor().unsafe_compute_mask_ptr(
        [(matcher.matcher, row) for row, matcher in enumerate(matchers)], masks.ctypes.data, words * 4, len(matchers)
    )
    for row, matcher in enumerate(matchers):
        matcher.next_mask = masks[row]


def allowed_tokens(mask: np.ndarray, width: int) -> torch.Tensor:
    """The boolean (width,) view of a bitmask: True where the token is allowed; ids past the mask are not."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
    allowed = np.zeros(width, dtype=bool)
    allowed[: min(width, bits.size)] = bits[:width]
    return torch.from_numpy(allowed)


EXECUTOR: list[Any] = []


def executor():
    """llguidance's thread pool for batches of masks, made once. Its threads compute masks only while the caller
    waits (or, in the server, while the model's step runs on the cores ONNX Runtime left)."""
    if not EXECUTOR:
        EXECUTOR.append(require_llguidance().LLExecutor())
    return EXECUTOR[0]
