"""Constrained decoding: answers kept inside a JSON schema, a regular expression, a list of choices or a grammar, by
masking at each step the tokens the constraint does not allow (llguidance computes the masks).

The server applies them per request (`response_format`, vLLM's `structured_outputs` and `guided_*` fields, tool
calls); `GrammarLogitsProcessor` applies the same constraint to `model.generate` on PyTorch and ONNX Runtime models.

    >>> from vaswani.constraints import Grammar, GrammarLogitsProcessor
    >>> processor = GrammarLogitsProcessor(Grammar.json_schema(schema), tokenizer)
    >>> model.generate(**inputs, logits_processor=[processor])
"""

from .grammars import Grammar
from .matching import (
    CompiledGrammar,
    GrammarMatcher,
    GrammarVocabulary,
    compile_grammar,
    fill_masks,
    grammar_vocabulary,
)
from .processor import GrammarLogitsProcessor

__all__ = [
    "CompiledGrammar",
    "Grammar",
    "GrammarLogitsProcessor",
    "GrammarMatcher",
    "GrammarVocabulary",
    "compile_grammar",
    "fill_masks",
    "grammar_vocabulary",
]
