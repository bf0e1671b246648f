"""How the scheduler chooses each sequence's next token: one sampler, the same as offline `generate`'s.

A sampled row's scores go through transformers' own logits processors, built from the request's values and applied in
the order `GenerationMixin._get_logits_processor` applies them (the repetition penalty, then the caller's processors,
here OpenAI's presence and frequency penalties, then temperature, top-k, top-p and min-p), and the token is drawn with
`torch.multinomial` from the row's own `torch.Generator`, seeded with the request's `seed`. So a seeded answer equals

    >>> torch.manual_seed(seed)
    >>> model.generate(ids, do_sample=True, temperature=T, top_k=K, top_p=P, min_p=M, repetition_penalty=R,
    ...                logits_processor=[PresenceFrequencyPenalty(presence, frequency, ids.shape[1])])

token for token at batch 1, and no row's draw depends on another's. A greedy row takes the highest score (after the
penalties, which `generate` applies in greedy search too), as `generate(do_sample=False)`.

Choosing is per row and fails per row: an exception while choosing one row's token (a NaN probability, say) ends that
sequence with an error, and the other rows of the batch get their tokens (`choose_tokens`).

    >>> sampler = RowSampler(prompt, SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1))
    >>> choices = choose_tokens(logits, [sampler])        # logits: (batch, vocab) float32
    >>> choices[0].token, choices[0].logprobs, choices[0].error
"""

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..constraints import CompiledGrammar, GrammarMatcher

log = logging.getLogger(__name__)

# vLLM's floor: a positive temperature below it is raised to it, so that logits / temperature stays finite (1e-320
# or 2.46e-308 overflowed float32 to inf, and the probabilities became NaN).
MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI's top_logprobs


@dataclass
class SamplingParams:
    """How one sequence chooses its tokens and when it stops.

    `temperature` 0 is greedy; a positive one below `MIN_TEMPERATURE` is raised to it. `top_k` 0 or -1 and `min_p` 0
    are off. `repetition_penalty` divides (multiplies, when negative) the scores of every token in the prompt and the
    answer so far (transformers' and vLLM's definition); `presence_penalty` and `frequency_penalty` subtract
    presence * [count > 0] + frequency * count over the answer's tokens (OpenAI's). `logprobs`: how many most likely
    alternatives to report with each token's log probability (None: no log probabilities). Invalid values raise
    `ValueError` naming the field.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to that token's score before anything else.
    logit_bias: dict[int, float] | None = None
    # vLLM's: the end-of-sequence and `request_stop_ids` are masked until the answer has `min_tokens` tokens.
    min_tokens: int = 0
    # vLLM's stop_token_ids: the request's own ids that end it with "stop" (also under `ignore_eos`).
    request_stop_ids: frozenset[int] = frozenset()
    # A constraint on the answer's text (JSON schema, regular expression, grammar): each row gets its own matcher,
    # which masks the tokens the grammar does not allow before anything else touches the scores.
    grammar: CompiledGrammar | None = None

    def __post_init__(self) -> None:
        checks = {
            "temperature": 0.0 <= self.temperature <= 2.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": self.top_k >= -1,
            "min_p": 0.0 <= self.min_p <= 1.0,
            "repetition_penalty": 0.0 < self.repetition_penalty < math.inf,
            "presence_penalty": -2.0 <= self.presence_penalty <= 2.0,
            "frequency_penalty": -2.0 <= self.frequency_penalty <= 2.0,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logit_bias": all(-100.0 <= bias <= 100.0 for bias in (self.logit_bias or {}).values()),
            "min_tokens": 0 <= self.min_tokens <= self.max_tokens,
        }
        for name, valid in checks.items():  # NaN fails every comparison, so it is caught here too
            if not valid:
                raise ValueError(f"{name} is out of range: {getattr(self, name)!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def ends(self) -> frozenset[int]:
        """The ids that end the answer: the request's stop ids, and the end-of-sequence unless `ignore_eos`."""
        if self.ignore_eos or not self.stop_token_ids:
            return self.request_stop_ids
        return self.stop_token_ids | self.request_stop_ids if self.request_stop_ids else self.stop_token_ids


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: adds each listed token's bias to its score (-100 all but bans it, 100 all but forces it)."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor | None, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids] += self.values.to(scores.dtype)
        return scores


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties as a transformers logits processor: subtracts
    `presence` * [count > 0] + `frequency` * count from each token's score, where count is how often the token occurs
    in the answer so far (the ids after the first `prompt_length`)."""

    def __init__(self, presence: float, frequency: float, prompt_length: int):
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        answer = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def logits_processors(params: SamplingParams, prompt_length: int) -> list[LogitsProcessor]:
    """transformers' processors for `params`, in `generate`'s order: penalties (greedy rows too), then the sampling
    warpers (sampled rows only), each only where its value changes something."""
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, prompt_length))
    if params.greedy:
        return processors
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(float(params.top_p)))
    if params.min_p > 0.0:
        processors.append(MinPLogitsWarper(float(params.min_p)))
    return processors


class TokenLogprobs(NamedTuple):
    """A chosen token's log probability and the `top` most likely tokens' (id, log probability), best first."""

    logprob: float
    top: list[tuple[int, float]]


class TokenChoice(NamedTuple):
    """One row's outcome: its `token`, or the `error` that kept it from getting one."""

    token: int | None
    logprobs: TokenLogprobs | None = None
    error: str | None = None


class RowSampler:
    """The token choice of one sequence: its processors, its random generator and, where a penalty needs them, the
    ids so far (prompt and answer)."""

    def __init__(self, prompt: list[int], params: SamplingParams):
        self.params = params
        self.processors = logits_processors(params, len(prompt))
        self.prompt_length = len(prompt)
        self.held_ends = torch.tensor(sorted(params.ends), dtype=torch.long) if params.min_tokens else None
        self.matcher: GrammarMatcher | None = params.grammar.matcher() if params.grammar is not None else None
        # Greedy rows without penalties, bias, a minimum or a grammar need nothing of their own: the batch's argmax
        # serves them.
        self.plain = params.greedy and not self.processors and self.held_ends is None and self.matcher is None
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed % 2**64)  # any integer, as OpenAI's seed
        self.ids: torch.Tensor | None = None
        self.length = len(prompt)
        if params.penalized:
            self.ids = torch.zeros((1, len(prompt) + params.max_tokens), dtype=torch.long)
            self.ids[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)

    def choose(self, logits: np.ndarray) -> int:
        """The next token for this row's `logits` (vocab,)."""
        scores = self.scores(logits)
        if self.generator is None:
            return int(scores.argmax(-1))
        probabilities = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, num_samples=1, generator=self.generator))

    def scores(self, logits: np.ndarray) -> torch.Tensor:
        """This row's scores (1, vocab) for `logits` (vocab,) after its grammar, `min_tokens` and processors: what
        `choose` takes the argmax of or samples from. Raises where no token is left."""
        scores = torch.from_numpy(np.array(logits, dtype=np.float32, copy=True))[None]  # the processors' own copy
        ids = self.ids[:, : self.length] if self.ids is not None else None
        if self.matcher is not None:
            scores = self.matcher.mask_scores(scores)
        if self.held_ends is not None and self.length - self.prompt_length < self.params.min_tokens:
            scores[:, self.held_ends] = -math.inf  # too short to end yet (vLLM's min_tokens)
        for processor in self.processors:
            scores = processor(ids, scores)
        if bool(torch.isneginf(scores).all()):
            raise ValueError(
                "no token is allowed: the request's grammar, logit_bias and min_tokens together exclude every token"
            )
        return scores

    def record(self, token: int) -> None:
        """Count `token` as part of the answer (for the penalties, and the grammar: a token that ends the answer is
        not part of its text)."""
        if self.matcher is not None and token not in self.params.ends:
            self.matcher.accept(token)
        if self.ids is not None and self.length < self.ids.shape[1]:
            self.ids[0, self.length] = token
        self.length += 1


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """`token`'s log probability and the `top` best alternatives'. As vLLM's default (`logprobs_mode="raw_logprobs"`),
    these are the model's own distribution: the log-softmax of the raw logits, before penalties, temperature and
    truncation, so they do not depend on the sampling values."""
    logprobs = torch.log_softmax(torch.from_numpy(np.asarray(logits, dtype=np.float32)), dim=-1)
    best: list[tuple[int, float]] = []
    if top > 0:
        values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = list(zip(indices.tolist(), values.tolist()))
    return TokenLogprobs(float(logprobs[token]), best)


def choose_tokens(logits: np.ndarray, samplers: list[RowSampler]) -> list[TokenChoice]:
    """The next token of each row of `logits` (batch, vocab), row `i` chosen by `samplers[i]`: greedy rows without
    penalties take the batch's argmax (the first maximum, as `torch.argmax`), the others go through their sampler.
    A row whose choice raises gets a `TokenChoice` with the error; the others are not affected."""
    argmax = logits.argmax(axis=-1).tolist() if any(sampler.plain for sampler in samplers) else None
    if all(sampler.plain and sampler.params.logprobs is None for sampler in samplers):
        return [TokenChoice(token) for token in argmax]  # greedy rows only: no torch work, nothing that can raise
    # torch's thread count is the process's, set once at startup (1 suits an ONNX model on a few cores). Each row's
    # work is on one vocabulary-wide vector, which gains nothing from threads, and torch's OpenMP workers compete for
    # the cores with ONNX Runtime's (on a loaded 2-core machine, a sampled row of a 49k vocabulary took 50 ms with 2
    # torch threads, 3 ms with one, most of it the exponential draw inside `torch.multinomial`, as in `generate`).
    return [choose_row(logits, row, sampler, argmax) for row, sampler in enumerate(samplers)]


def choose_row(logits: np.ndarray, row: int, sampler: RowSampler, argmax: list[int] | None) -> TokenChoice:
    """Row `row`'s token (from `argmax` for a plain greedy row) and log probabilities, or the error that stopped it."""
    try:
        token = argmax[row] if sampler.plain else sampler.choose(logits[row])
        logprobs = None
        if sampler.params.logprobs is not None:
            logprobs = token_logprobs(logits[row], token, sampler.params.logprobs)
        sampler.record(token)
        return TokenChoice(token, logprobs)
    except Exception as error:  # this row alone fails: its sequence ends with the error, the batch goes on
        log.exception("choosing a token failed for one row")
        return TokenChoice(None, None, f"{type(error).__name__}: {error}")
