"""Token ids to streamed text: incremental detokenization and stop strings.

A token does not always end on a character boundary (byte-level BPE splits multi-byte characters), and a stop string
can span tokens, so a stream cannot send each token's decoded piece as it comes. `TextStream` decodes the answer so
far, holds back an incomplete character (a trailing U+FFFD) and any tail that could still become a stop string, and
sends the rest; the concatenated deltas equal the decoded answer, cut before the first stop string.

    >>> stream = TextStream(tokenizer, stop=["\\n\\n"])
    >>> delta = stream.add(token)        # text safe to send now ("" while held back)
    >>> stream.stopped                   # True once a stop string appeared; nothing after it is sent
    >>> delta = stream.flush()           # at the end: what was held back
"""

from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Append `token`; return the new text that can be sent (possibly "")."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        at = earliest_stop(self.text, self.stop, self.sent)
        if at is not None:
            self.stopped = True
            self.text = self.text[:at]
            return self._take(len(self.text))
        safe = len(self.text)
        if self.text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            safe = len(self.text.rstrip("\ufffd"))
        safe -= self._held_for_stop(self.text[:safe])
        return self._take(max(safe, self.sent))

    def flush(self) -> str:
        """The text held back, at the end of the answer."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of `text` that is the start of a stop string (it may still complete)."""
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held


def earliest_stop(text: str, stops: list[str], sent: int) -> int | None:
    """Where `text` is cut: the start of the earliest stop string in it (not the first of the list: with ["e", "th"],
    "I saw the" ends before "th"), or None. Only matches the text after the first `sent` characters could have
    completed are looked for: the text before was checked already."""
    starts = [text.find(stop, max(0, sent - len(stop) + 1)) for stop in stops]
    return min((start for start in starts if start != -1), default=None)
