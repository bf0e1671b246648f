"""A lean loop for offline prompt-lookup speculation: `generate(prompt_lookup_num_tokens=N)` at batch 1 on an
exported causal LM, without transformers' assisted-generation machinery (a `forward` call, cache bookkeeping and
candidate generator per step: slower than the plain lean loop on a small model).

The loop runs on the server's batch of the export's decoder runtime (`step_model().new_batch()`: per-row lengths for
the GroupQueryAttention form, a left-padded cache for the others), which verifies a row's last token and its proposals
in one call (`Batch.verify`) and gives back the rejected ones (`Batch.rollback`). Proposals are transformers' prompt
lookup (`PromptLookupCandidateGenerator`: the tokens after the last earlier occurrence of the longest suffix n-gram,
`max_matching_ngram_size` (2) tokens long), except that a single recurring token is not looked up: such proposals were
mostly rejected (served, acceptance fell from 0.66 to 0.33 and the gain from 1.45x to 1.18x). Each position's scores go through the call's own logits processors on
the ids so far, then:

- greedy: the argmax; proposals are kept while they equal it, so the tokens are plain greedy search's;
- sampling: a proposal x is kept with probability p(x) under the processed distribution, else a token is drawn from p
  without x (the standard rejection rule: each token is distributed as plain sampling's), from torch's global
  generator as `generate` draws.

    >>> model.generate(ids, max_new_tokens=64, prompt_lookup_num_tokens=4)      # runs `prompt_lookup_sample`
"""

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import GenerationMode

from .lean_steps import apply_processors, effective_generation_config, greedy_tokens, lean_logits_processors

# transformers' `PromptLookupCandidateGenerator` default for the longest n-gram looked up.
DEFAULT_NGRAM = 2


def propose_ngram(tokens: list[int], count: int, longest: int, shortest: int) -> list[int]:
    """Up to `count` tokens that followed the last earlier occurrence of the longest suffix n-gram of `tokens`
    (`longest` down to `shortest` tokens); [] where no suffix recurs."""
    length = len(tokens)
    if count < 1:
        return []
    sequence = np.asarray(tokens, dtype=np.int64)
    for size in range(min(longest, length - 1), shortest - 1, -1):
        suffix = sequence[length - size :]
        # Candidate starts: where the suffix's first token occurs before the suffix itself, latest first.
        starts = np.flatnonzero(sequence[: length - size] == suffix[0])[::-1]
        for start in starts:
            if np.array_equal(sequence[start : start + size], suffix):
                return sequence[start + size : start + size + count].tolist()
    return []


def prompt_lookup_fits(
    model_config: GenerationConfig, generation_config: GenerationConfig | None, inputs: object, kwargs: dict
) -> bool:
    """Whether a `generate` call is prompt-lookup speculation that the lean loop runs: one unpadded prompt, greedy
    search or sampling otherwise as the plain lean loop takes it (no streamer, no returned dictionaries, no cache or
    draft model passed in, no custom loop)."""
    config = effective_generation_config(model_config, generation_config, kwargs)
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    mask = kwargs.get("attention_mask")
    return (
        config.prompt_lookup_num_tokens is not None
        and config.get_generation_mode(kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION
        and kwargs.get("assistant_model") is None
        and isinstance(ids, torch.Tensor)
        and ids.ndim == 2
        and ids.shape[0] == 1
        and (mask is None or bool(torch.as_tensor(mask).all()))
        and all(kwargs.get(name) is None for name in ("custom_generate", "streamer", "inputs_embeds"))
        and kwargs.get("cache", kwargs.get("past_key_values")) is None
        and not kwargs.get("synced_gpus")
        and not config.return_dict_in_generate
        and config.num_beams in (None, 1)
        and config.num_return_sequences in (None, 1)
    )


def prompt_lookup_sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    **model_kwargs,
) -> torch.LongTensor:
    """`generate`'s loop for `prompt_lookup_fits` calls (passed as its `custom_generate`): the prompt and the new
    tokens (1, length)."""
    step_model = model.decoder_runtime.step_model()
    prompt = input_ids[0].tolist()
    group = step_model.prefill_group([None], [prompt])
    logits = group.run(group.columns)[0]
    batch = step_model.new_batch()
    batch.join(group, [0])
    processors = lean_logits_processors(logits_processor)
    count = generation_config.prompt_lookup_num_tokens
    longest = generation_config.max_matching_ngram_size or DEFAULT_NGRAM
    max_length = generation_config.max_length
    sample = generation_config.do_sample
    token = choose(processors, input_ids, logits, sample)
    ids = torch.cat([input_ids, input_ids.new_tensor([[token]])], dim=-1)
    if bool(stopping_criteria(ids, None).all()):
        return ids
    while True:
        # `token` (the last of `ids`) is not in the cache yet: this step feeds it, and the proposals after it.
        room = min(count, max_length - ids.shape[1] - 1, step_model.context_length - ids.shape[1] - 1)
        proposals = propose_ngram(ids[0].tolist(), room, longest, min(2, longest))
        if proposals:
            rows = batch.verify([[token, *proposals]])[0]
        else:
            rows = batch.step(np.array([token], dtype=np.int64))
        kept = 0
        for position in range(len(proposals) + 1):
            proposal = proposals[position] if position < len(proposals) else None
            token = choose(processors, ids, rows[position], sample, proposal)
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=-1)
            if bool(stopping_criteria(ids, None).all()):
                return ids
            if token != proposal:
                break
            kept += 1
        if proposals:
            batch.rollback([len(proposals) - kept])


def choose(processors, ids: torch.Tensor, logits: np.ndarray, sample: bool, proposal: int | None = None) -> int:
    """The next token for `logits` (vocab,) after `ids`: greedy, a plain draw, or the rejection rule for `proposal`."""
    scores = apply_processors(processors, ids, torch.from_numpy(np.array(logits, dtype=np.float32))[None])
    if not sample:
        return int(greedy_tokens(scores)[0])
    probabilities = torch.softmax(scores, dim=-1)[0]
    if proposal is not None:
        kept = float(probabilities[proposal])
        if keeps(kept):
            return proposal
        probabilities[proposal] = 0.0
        if not float(probabilities.sum()) > 0.0:
            return proposal
    return int(torch.multinomial(probabilities, num_samples=1))


def keeps(probability: float) -> bool:
    """Whether a proposal of processed probability `probability` is kept: with that probability, drawn from torch's
    global generator (as `generate`'s sampling draws)."""
    return probability > 0.0 and float(torch.rand(())) < probability
