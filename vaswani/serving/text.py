"""Token ids to streamed text: incremental detokenization and stop strings.

A token does not always end on a character boundary (byte-level BPE splits multi-byte characters), and a stop string
can span tokens, so a stream cannot send each token's decoded piece as it comes. `TextStream` decodes a short window
of the answer per token (as vLLM's and text-generation-inference's detokenizers do): the tokens since a prefix offset,
whose text minus the prefix's own text is the new text; it holds back an incomplete character (a trailing U+FFFD)
until its other bytes come, and any tail that could still become a stop string, and sends the rest. The concatenated
deltas equal the decoded answer, cut before the first stop string, and the cost per token does not grow with the
answer (decoding the whole answer for every token made a long stream quadratic). With `include_stop`, the stop string
stays at the end of the text (vLLM's include_stop_str_in_output); `decoding` holds the tokenizer's `decode` options
(`skip_special_tokens`, `spaces_between_special_tokens`; the special tokens are skipped by default); a stop string
that ends within the text of the first `min_tokens` tokens does not stop the answer (vLLM's min_tokens).

    >>> stream = TextStream(tokenizer, stop=["\\n\\n"])
    >>> delta = stream.add(token)        # text safe to send now ("" while held back)
    >>> stream.stopped                   # True once a stop string appeared; nothing after it is sent
    >>> delta = stream.flush()           # at the end: what was held back
"""

from transformers import PreTrainedTokenizerBase


class TextStream:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: list[str] | None = None,
        include_stop: bool = False,
        decoding: dict[str, bool] | None = None,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.include_stop = include_stop
        self.decoding = {"skip_special_tokens": True} | (decoding or {})
        self.tokens: list[int] = []  # the tokens whose text is shown
        self.generated = 0  # every token of the answer, shown or not
        # vLLM's min_tokens: a stop string that ends in the text of the first `min_tokens` tokens does not stop.
        self.min_tokens, self.unchecked = min_tokens, 0
        # The decoding window: tokens[prefix_offset:read_offset] were decoded already (their text is the context the
        # next tokens are decoded in: a window starting mid-word decodes like the whole answer), tokens[read_offset:]
        # not yet (held back while they end in an incomplete character).
        self.prefix_offset = self.read_offset = 0
        self.sent = 0  # characters of the decoded text already returned
        self.text = ""  # the decoded text so far
        self.stopped = False

    def add(self, token: int, shown: bool = True) -> str:
        """Append `token` (counted only, unless `shown`); return the new text that can be sent (possibly "")."""
        self.generated += 1
        if self.stopped or not shown:
            return ""
        self.tokens.append(token)
        self.text += self._decode_new()
        if self.generated <= self.min_tokens:
            self.unchecked = len(self.text)
        at = earliest_stop(self.text, self.stop, max(self.sent, self.unchecked), self.include_stop)
        if at is not None:
            self.stopped = True
            self.text = self.text[:at]
            return self._take(len(self.text))
        safe = len(self.text) - self._held_for_stop(self.text)
        return self._take(max(safe, self.sent))

    def flush(self) -> str:
        """The text held back, at the end of the answer."""
        if not self.stopped:
            self.text += self._decode_new(final=True)
        return self._take(len(self.text))

    def _decode_new(self, final: bool = False) -> str:
        """The text the tokens since `read_offset` add, or "" while it ends in an incomplete character (unless
        `final`: then the replacement character is what the answer holds)."""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], **self.decoding)
        window = self.tokenizer.decode(self.tokens[self.prefix_offset :], **self.decoding)
        if len(window) <= len(prefix) or (window.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return window[len(prefix) :]

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


def earliest_stop(text: str, stops: list[str], sent: int, include: bool = False) -> int | None:
    """Where `text` is cut: the start of the earliest stop string in it (not the first of the list: with ["e", "th"],
    "I saw the" ends before "th"), or None; with `include`, the end of that stop string. Only matches the text after
    the first `sent` characters could have completed are looked for: the text before was checked already."""
    found = [(start, len(stop)) for stop in stops if (start := text.find(stop, max(0, sent - len(stop) + 1))) != -1]
    if not found:
        return None
    start, size = min(found)
    return start + size if include else start
