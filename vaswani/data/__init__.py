"""Data shipped with the package: `corpus.txt`, original short stories for training tiny models offline; the
byte-level BPE tokenizer trained on it (`tokenization.py`); chat data in the messages format (`chat.py`) and the
demo's chat set (`chat_demo.py`).

The corpus was written by `examples/make_corpus.py` (a small random grammar, fixed seed), not copied from
anywhere; stories are separated by a blank line.

Example:
    >>> from vaswani.data import corpus_stories, corpus_text
    >>> "Once upon a time, there was" in corpus_text()
    True
    >>> len(corpus_stories()) > 500
    True
"""

from functools import cache
from importlib.resources import files


@cache
def corpus_text() -> str:
    """The whole corpus (about 450 KB of English text) as one string."""
    return files(__name__).joinpath("corpus.txt").read_text(encoding="utf-8")


def corpus_stories() -> list[str]:
    """The corpus split into its stories (one paragraph each)."""
    return [story for story in corpus_text().split("\n\n") if story.strip()]


__all__ = ["corpus_stories", "corpus_text"]
