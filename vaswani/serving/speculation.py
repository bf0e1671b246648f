"""Speculative decoding in the server: prompt-lookup (n-gram) or draft-model proposals, verified in one step of the
model.

A row's proposals are the tokens that followed the last earlier occurrence of its sequence's longest suffix n-gram
(`prompt_lookup_max` down to `prompt_lookup_min` tokens; vLLM's "ngram" method, transformers'
`PromptLookupCandidateGenerator`), or a smaller model's greedy continuation ("draft_model": `draft.DraftProposer`). The
batch feeds each row its last token and its proposals in one call
(`Batch.verify`, the logits of every fed position), and the row's own sampler walks those positions in order
(`accept`): the penalties, `logit_bias`, `min_tokens` and log probabilities are applied exactly as in plain decoding,
one token at a time.

- greedy: a proposal is kept while it is the token plain decoding chooses there; the first mismatch is replaced by
  the model's choice, and after the last kept proposal the model's next token comes for free. The answer is plain
  greedy decoding's, token for token.
- sampled: the standard rejection rule for a deterministic proposal x: keep x with probability p(x) under the row's
  processed distribution p; otherwise draw from p with x removed (renormalized). Each token is then distributed as
  plain sampling's (P(x) = p(x), and P(y) = (1 - p(x)) p(y) / (1 - p(x)) for y != x); the draws differ, not their law.

The cache positions of rejected proposals are given back (`Batch.rollback`). A step where no row has a proposal, or
where a row is held to a grammar (its mask is computed beside a one-token step) or the batch is larger than
`disable_by_batch_size`, is a plain decoding step.

    >>> config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    >>> scheduler = Scheduler(step_model, speculator=Speculator(config))
"""

import json
import logging
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from ..runtime.speculative import propose_ngram
from .sampling import RowSampler, TokenChoice, token_logprobs

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys that apply here.

    `method`: "ngram" (prompt lookup) or "draft_model" (greedy proposals of `model`, a smaller export or PyTorch
    folder with the same tokenizer: `draft.DraftProposer`); `num_speculative_tokens`: proposals per row and step at
    most; `prompt_lookup_max`/`prompt_lookup_min`: the longest and shortest suffix n-gram looked up;
    `disable_by_batch_size`: no speculation in steps with more running rows than this (a step then computes k + 1
    positions per row, which pays only while the batch leaves the cores idle; None: no limit).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 4
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative config: method {self.method!r} is not supported; use one of {list(METHODS)}."
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                'speculative config: "model" (the draft\'s folder) goes with method "draft_model", and only with it; '
                'e.g. {"method": "draft_model", "model": "smaller-export", "num_speculative_tokens": 4}.'
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than prompt_lookup_max "
                f"({self.prompt_lookup_max}); make it at most that."
            )
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"speculative config: disable_by_batch_size must be a positive integer, got {limit!r}.")

    @classmethod
    def parse(cls, value: "str | dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """A config from a JSON object (as `--speculative-config` takes it), a dict, or a config; a ValueError names
        a bad key or value and the fix."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"speculative config is not valid JSON ({error}); pass an object such as "
                    '\'{"method": "ngram", "num_speculative_tokens": 4}\'.'
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}.")
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown key(s) {unknown}; the keys are {sorted(known)}.")
        return cls(**value)


def processed_probabilities(sampler: RowSampler, logits: np.ndarray) -> torch.Tensor:
    """The sampled row's distribution over the vocabulary (1, vocab) after its penalties and warpers: what
    `RowSampler.choose` draws from."""
    return torch.softmax(sampler.scores(logits), dim=-1)


def accept(sampler: RowSampler, logits: np.ndarray, proposals: list[int], ends: frozenset[int]) -> list[TokenChoice]:
    """Walk the logits of the fed positions (`logits`, (len(proposals) + 1, vocab)) with the row's sampler: each
    position's token is chosen (and recorded) as plain decoding would choose it, keeping proposals while the rule
    accepts them. Returns the row's new tokens: the kept proposals, then the model's own token (after a rejection,
    or after all were kept); it stops at an end token."""
    choices: list[TokenChoice] = []
    top = sampler.params.logprobs
    for position in range(len(proposals) + 1):
        row = logits[position]
        proposal = proposals[position] if position < len(proposals) else None
        if sampler.plain:
            token = int(row.argmax())  # as plain decoding serves such rows: numpy's first maximum, no torch work
        elif sampler.generator is None or proposal is None:
            token = sampler.choose(row)  # greedy, or the free token after the last kept proposal
        else:
            token = rejection_sample(sampler, row, proposal)
        logprobs = token_logprobs(row, token, top) if top is not None else None
        sampler.record(token)
        choices.append(TokenChoice(token, logprobs))
        if token != proposal or token in ends:
            break
    return choices


def rejection_sample(sampler: RowSampler, logits: np.ndarray, proposal: int) -> int:
    """The standard rule for a deterministic proposal: `proposal` with probability p(proposal), else a draw from p
    without it (renormalized), from the row's own generator."""
    probabilities = processed_probabilities(sampler, logits)[0]
    kept = float(probabilities[proposal])
    if kept > 0.0 and float(torch.rand((), generator=sampler.generator)) < kept:
        return proposal
    probabilities[proposal] = 0.0
    if not float(probabilities.sum()) > 0.0:  # p(proposal) was 1 up to rounding: nothing else can be drawn
        return proposal
    return int(torch.multinomial(probabilities, num_samples=1, generator=sampler.generator))


class Speculator:
    """The proposals, verification and acceptance of the scheduler's speculative steps, and their counts (for
    /metrics and /health): `drafts` (rows that got proposals, per step), `draft_tokens` (proposals made),
    `accepted_tokens` (proposals kept)."""

    def __init__(self, config: SpeculativeConfig, draft: Any = None):
        self.config = config
        self.draft = draft  # a `draft.DraftProposer` for method "draft_model"
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.steps = 0

    def stats(self) -> dict[str, Any]:
        rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
        return {
            "steps": self.steps,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": None if rate is None else round(rate, 4),
        }

    def proposals(self, sequences: list[Any], context_length: int) -> list[list[int]] | None:
        """Each row's proposals, or None where this step should be a plain one (a grammar row, a large batch, no
        proposals at all)."""
        config = self.config
        if config.disable_by_batch_size is not None and len(sequences) > config.disable_by_batch_size:
            return None
        if any(sequence.sampler.matcher is not None for sequence in sequences):
            return None
        proposed = []
        for sequence in sequences:
            # Room for the proposals and the token after them, within max_tokens and the context.
            room = min(
                sequence.params.max_tokens - len(sequence.generated) - 1,
                context_length - (sequence.position + 1) - 1,
                config.num_speculative_tokens,
            )
            tokens = sequence.prompt + sequence.generated
            if room < 1:
                proposed.append([])
            elif self.draft is not None:
                proposed.append(self.draft.propose(sequence, tokens, room))
            else:
                proposed.append(propose_ngram(tokens, room, config.prompt_lookup_max, config.prompt_lookup_min))
        return proposed if any(proposed) else None

    def step(self, batch: Any, sequences: list[Any], proposed: list[list[int]]) -> list[list[TokenChoice]]:
        """Verify `proposed` on `batch` (one call: each row's last token and its proposals), choose each row's
        tokens (`accept`) and give back the cache of the rejected proposals. A row whose choice fails gets one
        choice with the error."""
        fed = [[sequence.generated[-1], *proposals] for sequence, proposals in zip(sequences, proposed)]
        logits = batch.verify(fed)
        chosen, rejected = [], []
        for row, (sequence, proposals) in enumerate(zip(sequences, proposed)):
            try:
                choices = accept(sequence.sampler, logits[row], proposals, sequence.params.ends)
            except Exception as error:  # this row alone fails, as in plain decoding
                log.exception("choosing a token failed for one row")
                choices = [TokenChoice(None, None, f"{type(error).__name__}: {error}")]
            kept = max(0, len(choices) - 1) if choices[-1].error is None else 0
            chosen.append(choices)
            rejected.append(len(proposals) - kept)
            if proposals:
                self.drafts += 1
                self.draft_tokens += len(proposals)
                self.accepted_tokens += kept
        batch.rollback(rejected)
        self.steps += 1
        return chosen


class SpeculationCollector:
    """The speculator's counts as Prometheus counters (vLLM's names under the `vaswani_` prefix), read at each
    scrape: the scheduler thread only increments integers."""

    COUNTERS = (
        ("drafts", "vaswani_spec_decode_num_drafts", "Rows that got proposed tokens, per speculative step."),
        ("draft_tokens", "vaswani_spec_decode_num_draft_tokens", "Tokens proposed for verification."),
        ("accepted_tokens", "vaswani_spec_decode_num_accepted_tokens", "Proposed tokens that were kept."),
    )

    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for attribute, name, documentation in self.COUNTERS:
            yield CounterMetricFamily(name, documentation, value=getattr(self.speculator, attribute))


def speculator_for(
    config: "str | dict[str, Any] | SpeculativeConfig | None", provider: str = "cpu", threads: int | None = None
) -> Speculator | None:
    """The server's speculator for `config` (None: off, the default), checked (and a draft model loaded, on
    `provider` with `threads`) before the target loads; the choice is logged."""
    if config is None:
        return None
    config = SpeculativeConfig.parse(config)
    draft = None
    if config.method == "draft_model":
        from .draft import DraftProposer, load_draft

        draft = DraftProposer(load_draft(config.model, provider, threads))
    log.info("%s", describe(config))
    return Speculator(config, draft)


def check_draft(speculator: Speculator | None, vocab_size: int) -> None:
    """Refuse a draft model whose vocabulary is not the target's (its proposals would be other tokens' ids)."""
    if speculator is not None and speculator.draft is not None and speculator.draft.model.vocab_size != vocab_size:
        raise ValueError(
            f"speculative config: the draft model {speculator.config.model!r} has a vocabulary of "
            f"{speculator.draft.model.vocab_size} tokens, the served model {vocab_size}; a draft must share the "
            "served model's tokenizer."
        )


def describe(config: SpeculativeConfig) -> str:
    """One line for the log: what the server speculates with."""
    limit = config.disable_by_batch_size
    source = (
        f"the draft model {config.model}"
        if config.method == "draft_model"
        else f"suffix n-grams of {config.prompt_lookup_max} down to {config.prompt_lookup_min} tokens"
    )
    return (
        f"speculative decoding: {config.method}, up to {config.num_speculative_tokens} proposed tokens per step from "
        f"{source}"
        + (f", in steps of at most {limit} rows" if limit is not None else "")
        + "; the acceptance rate is at /metrics"
    )
