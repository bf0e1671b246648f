"""The scoring half of `vaswani.evaluation.perplexity`'s causal-LM definition, for the engines' tools (gguf_tools.py,
openvino_tools.py, ortgenai_tools.py), which run in venvs without vaswani or torch.

The driver (benchmarks/engine_perplexity.py) tokenizes the text once and cuts it with
`vaswani.evaluation.perplexity.strided_windows`; each window arrives as {"ids": [...], "scored_from": K}: its tokens, and the
first of them that is scored (the tokens before K are context only). An engine runs the window from an empty cache
and passes its logits here, so every engine scores the same tokens with the same context as `vaswani perplexity`.

    >>> total = Total()
    >>> for ids, scored_from in request_windows(request):  # doctest: +SKIP
    ...     total.add(logits_of(ids), ids, scored_from)
    >>> total.result()  # doctest: +SKIP
    {'perplexity': ..., 'mean_nll': ..., 'tokens': ...}
"""

import math

import numpy as np


def request_windows(request: dict) -> list[tuple[list[int], int]]:
    """(ids, first scored position) of each window of a request."""
    return [(window["ids"], window["scored_from"]) for window in request["windows"]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, so that summing hundreds of losses per window loses nothing to rounding."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class Total:
    """The summed negative log-likelihood over windows, and the number of tokens scored."""

    def __init__(self) -> None:
        self.nll, self.tokens = 0.0, 0

    def add(self, logits: np.ndarray, ids: list[int], scored_from: int) -> None:
        """Score `ids[scored_from:]` from `logits`, the window's (length, vocabulary) next-token logits."""
        if len(logits) < len(ids) - 1:
            raise RuntimeError(f"the engine returned logits for {len(logits)} positions of a {len(ids)}-token window")
        targets = np.asarray(ids[scored_from:])
        rows = log_softmax(np.asarray(logits)[scored_from - 1 : len(ids) - 1])
        self.nll -= float(rows[np.arange(len(targets)), targets].sum())
        self.tokens += len(targets)

    def result(self) -> dict:
        mean = self.nll / self.tokens
        return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens": self.tokens}
