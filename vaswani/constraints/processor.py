"""Constrained decoding offline: a transformers `LogitsProcessor` that keeps `generate`'s answers inside a grammar,
on PyTorch models and ONNX Runtime folders alike, token for token as `vaswani serve` constrains them.

    >>> from vaswani.constraints import Grammar, GrammarLogitsProcessor
    >>> schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    >>> processor = GrammarLogitsProcessor(Grammar.json_schema(schema), tokenizer)
    >>> output = model.generate(**inputs, logits_processor=[processor], max_new_tokens=64)
    >>> json.loads(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))

Each row of the batch gets its own matcher (greedy search, sampling, `num_return_sequences`); once a row's grammar is
complete only its end-of-sequence ids are allowed, so `generate` stops it there. Beam search reorders rows between
steps, which a matcher per row cannot follow: the processor raises a ValueError when the rows it sees are not the
continuations of those it saw before.
"""

import torch
from transformers import LogitsProcessor

from .grammars import Grammar
from .matching import GrammarMatcher, compile_grammar, fill_masks, grammar_vocabulary


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks every token `grammar` does not allow next.

    Args:
        grammar: the constraint (`Grammar.json_schema(...)`, `Grammar.regex(...)`, ...).
        tokenizer: the model's (fast) tokenizer.
        eos_token_id: the id(s) that end an answer (default: the tokenizer's end-of-sequence); allowed once the
            grammar is complete. Pass the model's `generation_config.eos_token_id` when it lists more than one.
        vocab_size: the width of the model's logits when it differs from the tokenizer's length.

    One processor serves one `generate` call (it keeps each row's place in the grammar); make a new one per call.
    """

    def __init__(
        self,
        grammar: Grammar,
        tokenizer,
        eos_token_id: int | list[int] | None = None,
        vocab_size: int | None = None,
    ):
        ends = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        self.vocabulary = grammar_vocabulary(tokenizer, vocab_size, ends)
        self.compiled = compile_grammar(grammar, self.vocabulary)
        self.end_ids = torch.tensor(self.vocabulary.end_ids, dtype=torch.long)
        self.matchers: list[GrammarMatcher] = []
        self.answers: list[list[int]] = []  # each row's tokens so far (to check the rows keep their order)
        self.ended: list[bool] = []
        self.prompt_length = 0
        self.steps = 0  # tokens generated so far

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.matchers:
            self.matchers = [self.compiled.matcher() for _ in range(input_ids.shape[0])]
            self.answers = [[] for _ in self.matchers]
            self.ended = [False] * len(self.matchers)
            self.prompt_length = input_ids.shape[1]
        else:
            self.advance(input_ids)
        live = [row for row, ended in enumerate(self.ended) if not ended and not self.matchers[row].finished]
        fill_masks([self.matchers[row] for row in live])
        scores = scores.clone()
        for row, matcher in enumerate(self.matchers):
            if self.ended[row]:
                continue  # generate pads a finished row whatever its scores
            if matcher.finished:
                only_ends = torch.full_like(scores[row], -torch.inf)
                only_ends[self.end_ids] = scores[row, self.end_ids]
                scores[row] = only_ends
            else:
                scores[row] = matcher.mask_scores(scores[row])
        return scores

    def advance(self, input_ids: torch.LongTensor) -> None:
        """Feed each row's newest token to its matcher (an end id ends the row)."""
        self.steps += 1
        if input_ids.shape[0] != len(self.matchers) or input_ids.shape[1] != self.prompt_length + self.steps:
            raise ValueError(
                "GrammarLogitsProcessor serves one generate call over the same rows; make a new processor per call."
            )
        for row, matcher in enumerate(self.matchers):
            if self.ended[row]:
                continue
            if (
                input_ids[row, self.prompt_length : self.prompt_length + len(self.answers[row])].tolist()
                != self.answers[row]
            ):
                raise ValueError(
                    "The batch's rows were reordered between steps (beam search): constrained decoding supports "
                    "greedy search and sampling (num_beams=1)."
                )
            token = int(input_ids[row, -1])
            self.answers[row].append(token)
            if token in self.vocabulary.end_ids:
                self.ended[row] = True
            else:
                matcher.accept(token)
