"""Train a byte-level BPE tokenizer locally (no download) and wrap it as a transformers fast tokenizer.

Byte-level BPE (as in GPT-2) starts from the 256 byte values, so any text, in any script, encodes without an
unknown token; training only adds merges. The result is a `transformers.PreTrainedTokenizerFast` with
`bos`/`eos` (`<|endoftext|>`) and `pad` (`<|pad|>`) set, so `generate`, `pipeline` and data collators work
with it and `save_pretrained` writes it beside a model.

Example:
    >>> from vaswani.data import corpus_stories
    >>> from vaswani.data.tokenization import train_tokenizer
    >>> tokenizer = train_tokenizer(corpus_stories(), vocab_size=1000)
    >>> tokenizer.decode(tokenizer("Once upon a time").input_ids)
    'Once upon a time'
    >>> tokenizer.eos_token, tokenizer.pad_token
    ('<|endoftext|>', '<|pad|>')
"""

from collections.abc import Iterable
from functools import lru_cache
from os import PathLike

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from . import corpus_stories

ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, PAD)  # ids 0 and 1, before the 256 byte tokens
BYTE_ALPHABET_SIZE = 256


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 1000,
    *,
    min_frequency: int = 2,
    model_max_length: int = 1024,
    save_directory: str | PathLike[str] | None = None,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and return it as a transformers fast tokenizer.

    Args:
        texts: Training text, e.g. a list of documents (many short strings train faster than one long one).
        vocab_size: Size of the final vocabulary, special tokens and the 256 byte tokens included; must be
            larger than 258. Training stops early if the text has no more pairs seen `min_frequency` times.
        min_frequency: Merge only pairs seen at least this often.
        model_max_length: Longest input the tokenizer reports as allowed (`tokenizer.model_max_length`); match
            it to the model's `max_position_embeddings`.
        save_directory: If given, also `save_pretrained` the tokenizer there.
        show_progress: Show the `tokenizers` trainer's progress bar.

    Returns:
        A `PreTrainedTokenizerFast` with `bos_token = eos_token = "<|endoftext|>"` (id 0) and
        `pad_token = "<|pad|>"` (id 1). It adds no special tokens on its own: append `eos_token` between
        documents when building training data.

    Example:
        >>> tokenizer = train_tokenizer(["a tiny corpus", "of two documents"], vocab_size=300)
        >>> tokenizer.save_pretrained("my-tokenizer")  # doctest: +SKIP
        >>> AutoTokenizer.from_pretrained("my-tokenizer")  # doctest: +SKIP
    """
    smallest = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if isinstance(texts, str):
        raise TypeError("texts must be an iterable of strings, not one string: wrap it in a list, e.g. [text].")
    if not isinstance(vocab_size, int) or vocab_size <= smallest:
        raise ValueError(
            f"vocab_size={vocab_size!r} is too small: byte-level BPE needs {BYTE_ALPHABET_SIZE} byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens, so use more than {smallest} (e.g. 300 for tests, 1000-8000 to train)."
        )
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text, which `pipeline` relies on to echo the prompt.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = _wrap(backend, model_max_length)
    if save_directory is not None:
        tokenizer.save_pretrained(save_directory)
    return tokenizer


def corpus_tokenizer(vocab_size: int = 1000, kilobytes: int | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer trained on the packaged corpus (`vaswani.data`); memoized, so tests can call it freely.

    Args:
        vocab_size: As in `train_tokenizer`.
        kilobytes: Train on only the first this many KB of the corpus (faster); `None` uses all of it.

    Each call returns a new tokenizer object (adding tokens to one does not change the next), built from a
    cached trained backend:

        >>> tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
        >>> len(tokenizer)
        300
    """
    return _wrap(Tokenizer.from_str(_corpus_tokenizer_json(vocab_size, kilobytes)), model_max_length=1024)


@lru_cache(maxsize=8)
def _corpus_tokenizer_json(vocab_size: int, kilobytes: int | None) -> str:
    stories, size = [], 0
    for story in corpus_stories():
        if kilobytes is not None and size >= kilobytes * 1000:
            break
        stories.append(story)
        size += len(story)
    return train_tokenizer(stories, vocab_size=vocab_size).backend_tokenizer.to_str()


def _wrap(backend: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


__all__ = ["corpus_tokenizer", "train_tokenizer"]
