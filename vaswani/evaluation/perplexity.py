"""Perplexity of a model folder on a text: one definition for every folder `vaswani.runtime.loading.load_folder` loads
(PyTorch or ONNX export, any precision); `vaswani perplexity` (`vaswani.cli.perplexity`) runs `folder_perplexity`.

What is scored depends on the model's objective:
- causal LM: strided windows, the definition of transformers' perplexity guide. Windows of `context` tokens start
  every `stride` tokens; the first window scores all its tokens (but the very first, which has no left context),
  each later window scores only the tokens the previous one did not reach, each with as much left context as its
  window gives it. `stride == context` gives consecutive, independent windows; a smaller stride gives every token
  at least `context - stride` tokens of context.
- masked LM: masked-token perplexity over consecutive windows of `context` tokens: 15% of positions (at least the
  first of each window) are replaced by the mask token, chosen by a generator seeded with `seed`, so every form of
  the same model scores the same positions.
- encoder-decoder: teacher-forced reconstruction of each window of `context` tokens (the encoder reads the window,
  the decoder predicts it from the decoder start token).

Usage:
    >>> from vaswani.evaluation.perplexity import folder_perplexity
    >>> result = folder_perplexity("outputs/chat-onnx", open("story.txt").read(), context=512, stride=256)
    >>> result.perplexity, result.tokens  # doctest: +SKIP
    (9.81, 1023)

    $ vaswani perplexity outputs/chat-onnx --text story.txt --context 512 --stride 256 --json ppl.json
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The share of positions a masked LM is asked to fill, as in BERT's pre-training.
MASKED_SHARE = 0.15


@dataclass
class Perplexity:
    """A perplexity and how it was measured: `mean_nll` is the mean negative log-likelihood (nats) of the `tokens`
    scored, `perplexity` its exp; `context` and `stride` are the windows' length and step in tokens; `task` is
    "text-generation", "fill-mask" or "text2text-generation"; `form` "pytorch" or "onnx"."""

    perplexity: float
    mean_nll: float
    tokens: int
    context: int
    stride: int
    task: str
    form: str

    def describe(self) -> str:
        """One readable line, as `vaswani perplexity` prints it."""
        return (
            f"perplexity {self.perplexity:.4f} (mean NLL {self.mean_nll:.4f} nats) over {self.tokens} tokens, "
            f"context {self.context}, stride {self.stride}, {self.task}, {self.form}"
        )


def strided_windows(length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows that score a sequence of `length` tokens: (start, end, first scored position), positions in the
    sequence. Every position but the first is scored exactly once.

    >>> strided_windows(10, context=4, stride=2)
    [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]
    """
    check_windows(context, stride)
    windows, scored_until = [], 1
    for start in range(0, length, stride):
        end = min(start + context, length)
        # A window's first token has no left context inside it, so it is never scored there.
        first = max(scored_until, start + 1)
        if first < end:
            windows.append((start, end, first))
        scored_until = end
        if end == length:
            break
    return windows


def check_windows(context: int, stride: int) -> None:
    """Raise a ValueError naming the problem if `context` and `stride` cannot make windows."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens (got {context}): one token has nothing to predict.")
    if not 1 <= stride <= context:
        raise ValueError(
            f"stride must be between 1 and the context ({context}), got {stride}: a larger stride would skip tokens."
        )


def _causal_nll(
    model: Any, ids: torch.Tensor, context: int, stride: int, device: str, batch_tokens: int
) -> tuple[float, int]:
    total, count = 0.0, 0
    windows = strided_windows(ids.numel(), context, stride)
    # Windows of one length run as one batch (all but the last are full), up to `batch_tokens` tokens at a time.
    batch_size = max(1, batch_tokens // context)
    while windows:
        length = windows[0][1] - windows[0][0]
        batch = [window for window in windows[:batch_size] if window[1] - window[0] == length]
        windows = windows[len(batch) :]
        inputs = torch.stack([ids[start:end] for start, end, _ in batch]).to(device)
        logits = model(input_ids=inputs).logits
        for row, (start, end, first) in enumerate(batch):
            scored = logits[row, first - start - 1 : end - start - 1]
            targets = inputs[row, first - start :]
            total += torch.nn.functional.cross_entropy(scored.float(), targets, reduction="sum").item()
            count += targets.numel()
    return total, count


def _masked_nll(
    model: Any, ids: torch.Tensor, context: int, mask_token_id: int | None, seed: int, device: str
) -> tuple[float, int]:
    if mask_token_id is None:
        raise ValueError("this masked LM's tokenizer has no mask token, so masked-token perplexity cannot be measured.")
    generator = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for start in range(0, ids.numel(), context):
        window = ids[start : start + context][None]
        chosen = torch.rand(window.shape, generator=generator) < MASKED_SHARE
        chosen[0, 0] = True  # at least one scored position per window
        logits = model(input_ids=window.masked_fill(chosen, mask_token_id).to(device)).logits[chosen.to(device)]
        total += torch.nn.functional.cross_entropy(logits.float(), window[chosen].to(device), reduction="sum").item()
        count += int(chosen.sum())
    return total, count


def _seq2seq_nll(model: Any, ids: torch.Tensor, context: int, device: str) -> tuple[float, int]:
    start_token = model.config.decoder_start_token_id
    total, count = 0.0, 0
    for start in range(0, ids.numel(), context):
        window = ids[start : start + context][None].to(device)
        decoder_input_ids = torch.cat([torch.full_like(window[:, :1], start_token), window[:, :-1]], dim=1)
        logits = model(input_ids=window, decoder_input_ids=decoder_input_ids).logits[0]
        total += torch.nn.functional.cross_entropy(logits.float(), window[0], reduction="sum").item()
        count += window.numel()
    return total, count


def summed_nll(
    model: Any,
    ids: Sequence[int] | torch.Tensor,
    task: str,
    context: int,
    stride: int | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_tokens: int = 1,
) -> tuple[float, int]:
    """The summed negative log-likelihood (nats) and the number of tokens scored, for `model` (a PyTorch module or
    an `OrtModelFor...`) on the token `ids` of one text, by the definition of `task` (see the module docstring).
    Sums of several texts add up, so `math.exp(sum of totals / sum of counts)` is their joint perplexity.
    `batch_tokens` > `context` runs a causal LM's full windows in batches of that many tokens (PyTorch models; an
    export's graph may take batches too); the default runs one window at a time.

    >>> total, count = summed_nll(model, ids, "text-generation", context=256, stride=128)  # doctest: +SKIP
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten().cpu()
    stride = context if stride is None else stride
    check_windows(context, stride)
    with torch.no_grad():
        if task == "text-generation":
            return _causal_nll(model, ids, context, stride, device, batch_tokens)
        if stride != context:
            raise ValueError(
                f"a {task} model is scored on consecutive windows: leave stride at the context ({context})."
            )
        if task == "fill-mask":
            return _masked_nll(model, ids, context, mask_token_id, seed, device)
        if task == "text2text-generation":
            return _seq2seq_nll(model, ids, context, device)
    raise ValueError(f"perplexity needs a text-generation, fill-mask or text2text-generation model, not {task!r}.")


def max_positions(model: Any) -> int | None:
    """The longest input the model's positions allow, if its config says (None for unbounded positions)."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def text_ids(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    """The text's token ids without special tokens (every form of a model reads the same ids), at most `max_tokens`."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids if max_tokens is None else ids[:max_tokens]


def model_perplexity(
    model: Any,
    tokenizer: Any,
    texts: str | Sequence[str],
    task: str,
    form: str,
    context: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    batch_tokens: int = 1,
) -> Perplexity:
    """The perplexity of a loaded `model` on `texts` (one text, or several scored separately and pooled: no window
    crosses from one text into the next). `context` defaults to the model's max positions, capped at 1024; `stride`
    to the context; `max_tokens` caps each text's tokens; `seed` picks a masked LM's positions; `batch_tokens` as in
    `summed_nll`.

    >>> model_perplexity(model, tokenizer, ["a story ...", "some code ..."], "text-generation", "pytorch",
    ...                  context=512, stride=256)  # doctest: +SKIP
    Perplexity(perplexity=9.8, mean_nll=2.28, tokens=2046, context=512, stride=256, ...)
    """
    limit = max_positions(model)
    if context is None:
        context = min(limit or 1024, 1024)
    if limit is not None and context > limit:
        raise ValueError(
            f"context {context} is longer than the model's {limit} positions: pass --context {limit} or less."
        )
    stride = context if stride is None else stride
    check_windows(context, stride)
    texts = [texts] if isinstance(texts, str) else list(texts)
    total, count = 0.0, 0
    for text in texts:
        ids = text_ids(tokenizer, text, max_tokens)
        text_total, text_count = summed_nll(
            model, ids, task, context, stride, getattr(tokenizer, "mask_token_id", None), seed, device, batch_tokens
        )
        total, count = total + text_total, count + text_count
    if count == 0:
        raise ValueError("the text gives no tokens to score: pass a text of at least two tokens.")
    return Perplexity(math.exp(total / count), total / count, count, context, stride, task, form)


def folder_perplexity(
    folder: str | os.PathLike,
    texts: str | Sequence[str],
    context: int | None = None,
    stride: int | None = None,
    max_tokens: int | None = None,
    device: str = "cpu",
    threads: int | None = None,
    engine: str = "onnxruntime",
    openvino_precision: str = "auto",
) -> Perplexity:
    """The perplexity of the model in `folder` (a PyTorch folder or an ONNX export) on `texts`; see
    `model_perplexity` for the arguments, `load_folder` for `engine` (the runtime of an ONNX export, as `--engine`)
    and `openvino_precision`.

    >>> folder_perplexity("outputs/chat-onnx", open("story.txt").read(), context=512).perplexity  # doctest: +SKIP
    """
    from ..runtime.loading import load_folder

    loaded = load_folder(folder, device, threads, engine=engine, openvino_precision=openvino_precision)
    return model_perplexity(
        loaded.model, loaded.tokenizer, texts, loaded.task, loaded.form, context, stride, max_tokens, device=device
    )
