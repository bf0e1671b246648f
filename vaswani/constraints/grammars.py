"""What a constrained answer must match: a JSON schema, any JSON object, a regular expression, one of a list of
strings, or a context-free grammar (Lark, or GBNF/EBNF as llama.cpp and vLLM write it).

A `Grammar` is a plain value, written once from whatever the user sent and compiled against a tokenizer's vocabulary
later (`compile_grammar`, which caches): the server builds one per request, `GrammarLogitsProcessor` takes one for
`generate`.

    >>> Grammar.json_schema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    >>> Grammar.choice(["positive", "negative"])
    >>> Grammar.regex(r"\\d{3}-\\d{4}")
    >>> Grammar.grammar('root ::= "yes" | "no"')

The engine is llguidance (on PyPI, no dependencies). It was chosen over xgrammar by measurement on SmolLM2's
49,152-token vocabulary (`benchmarks/benchmark_grammar_libraries.py`, docs/results/structured_outputs_cpu.md): it
compiles a grammar 2-16x faster, and with each library's own path a token costs a third of xgrammar's (whose CPU
apply kernel is the slow part: xgrammar's masks applied as this package applies llguidance's are 1.2-1.4x cheaper
than llguidance's, both far below a decoding step, during which the server computes them); and it needs none of
xgrammar's dependencies (triton, apache-tvm-ffi, a torch requirement of its own).
"""

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "regex", "choice", "grammar", "lark"]
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "grammar", "lark")
# The whitespace a flexible JSON answer may put between two of its tokens: one line break and up to 20 spaces or
# tabs, enough for compact, spaced and pretty-printed JSON (10 levels at indent 2). Unbounded whitespace, the JSON
# grammar's, lets a model that prefers a newline write newlines until max_tokens: a random-weight model did so at
# the first gap, greedy, and trained models are known to (vLLM's `disable_any_whitespace` exists for them).
JSON_WHITESPACE = r"(\r?\n)?[ \t]{0,20}"


def require_llguidance():
    """The llguidance module, or an ImportError that says how to get it."""
    try:
        import llguidance
    except ImportError as error:
        raise ImportError(
            "Constrained decoding (JSON schemas, regular expressions, grammars, tool calls) needs llguidance: "
            "pip install 'vaswani[structured]' (vaswani[serve] includes it)."
        ) from error
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A constraint on the text of an answer. Build it with one of the class methods; `source` is its text (a JSON
    schema or choice list as JSON, a regular expression, a grammar).

    `flexible_whitespace` (JSON only): whether the answer may put whitespace between JSON tokens (a line break and
    up to 20 spaces: `JSON_WHITESPACE`) or must write it compactly (`{"a":1,"b":[2,3]}`; vLLM's
    `disable_any_whitespace`).
    """

    kind: GrammarKind
    source: str
    flexible_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"Unknown grammar kind {self.kind!r}; use one of {', '.join(GRAMMAR_KINDS)}.")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, flexible_whitespace: bool = True) -> "Grammar":
        """An answer that is JSON valid under `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"The JSON schema is not valid JSON: {error}.") from None
        if not isinstance(schema, dict):
            raise ValueError(f"A JSON schema is a JSON object, got {type(schema).__name__}.")
        return cls("json_schema", json.dumps(schema), flexible_whitespace)  # key order kept: it is the answer's

    @classmethod
    def json_object(cls, flexible_whitespace: bool = True) -> "Grammar":
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"}, flexible_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """An answer the regular expression `pattern` matches whole (Rust's `regex` syntax, as vLLM's backends)."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("A regular expression constraint needs a non-empty pattern.")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "Grammar":
        """An answer that is exactly one of `options`."""
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("A choice constraint needs a non-empty list of non-empty strings.")
        return cls("choice", json.dumps(options))

    @classmethod
    def grammar(cls, text: str) -> "Grammar":
        """A context-free grammar: Lark (llguidance's dialect) or GBNF/EBNF (llama.cpp's, vLLM's `guided_grammar`)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("A grammar constraint needs the grammar's text.")
        return cls("grammar", text)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A grammar in llguidance's Lark dialect (its `%json {...}` embeds a JSON schema: the tool-call grammars)."""
        return cls("lark", text)

    def llguidance_grammar(self) -> str:
        """This constraint as llguidance's grammar text; a ValueError when it cannot be read."""
        llguidance = require_llguidance()
        matcher = llguidance.LLMatcher
        if self.kind == "json_schema":
            options: dict[str, Any] = {"whitespace_flexible": self.flexible_whitespace}
            if self.flexible_whitespace:
                options["whitespace_pattern"] = JSON_WHITESPACE
            return matcher.grammar_from_json_schema(self.source, defaults=options)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return matcher.grammar_from_lark(self.source)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(option) for option in json.loads(self.source))
            return matcher.grammar_from_lark(f"start: {alternatives}")
        try:  # Lark or GBNF: llguidance tells them apart and converts GBNF
            return llguidance.grammar_from("grammar", self.source)
        except ValueError as error:
            raise ValueError(f"The grammar could not be read: {error}") from None

    def describe(self) -> str:
        """A short name for logs and errors: 'JSON schema', 'regular expression', ..."""
        return {
            "json_schema": "JSON schema",
            "regex": "regular expression",
            "choice": "choice",
            "grammar": "grammar",
            "lark": "grammar",
        }[self.kind]
