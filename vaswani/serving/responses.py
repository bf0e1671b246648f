"""The OpenAI API's response bodies, as plain dicts: a streamed chunk costs one `json.dumps` and no model validation.

`completion_body` is a whole answer, `chunk_body` one server-sent event of a streamed one, `usage_chunk_body` the
usage at a stream's end; the log probabilities come in the chat route's shape (`chat_logprobs_body`) or the legacy
completions route's (`text_logprobs_body`).
"""

import time
import uuid
from typing import Any, Literal


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens the prefix cache supplied (OpenAI's and vLLM's
    `prompt_tokens_details`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    kind: Literal["chat", "text"],
    id: str,
    model: str,
    choices: list[tuple[str | None, str]],
    usage: dict[str, int],
    logprobs: list[dict[str, Any] | None] | None = None,
    tool_calls: list[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer; `choices` holds (text, finish_reason) per choice, `logprobs` each choice's log
    probabilities body (`chat_logprobs_body`, `text_logprobs_body`) where they were asked for, `tool_calls` each chat
    choice's calls (OpenAI's `tool_calls` entries) where the request offered tools."""
    logprobs = logprobs or [None] * len(choices)
    if kind == "chat":
        messages = [{"role": "assistant", "content": text} for text, _ in choices]
        for message, calls in zip(messages, tool_calls or []):
            if calls:
                message["tool_calls"] = calls
        entries = [
            {"index": i, "message": message, "finish_reason": reason, "logprobs": lp}
            for i, (message, (_, reason), lp) in enumerate(zip(messages, choices, logprobs))
        ]
        obj = "chat.completion"
    else:
        entries = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
            for i, ((text, reason), lp) in enumerate(zip(choices, logprobs))
        ]
        obj = "text_completion"
    return {"id": id, "object": obj, "created": int(time.time()), "model": model, "choices": entries, "usage": usage}


def chunk_body(
    kind: Literal["chat", "text"],
    id: str,
    created: int,
    model: str,
    index: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    logprobs: dict[str, Any] | None = None,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One server-sent event of a streamed answer, in OpenAI's chunk format; `logprobs`: those of the tokens whose
    text this chunk carries; `delta` (chat): the chunk's delta as given (a tool call's piece) instead of `text`."""
    if kind == "chat":
        if delta is None:
            delta = {"content": text} if text is not None else {}
        if role:
            delta = {"role": "assistant", **delta}
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [choice]}


# A token's log probability as the bodies take it: (the token's text, its log probability, the most likely tokens'
# (text, log probability), best first).
TokenEntry = tuple[str, float, list[tuple[str, float]]]


def chat_logprobs_body(tokens: list[TokenEntry]) -> dict[str, Any]:
    """The chat route's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(text, lp) | {"top_logprobs": [entry(*best) for best in top]} for text, lp, top in tokens]}


def text_logprobs_body(tokens: list[TokenEntry], offset: int) -> dict[str, Any]:
    """The completions route's (legacy) `logprobs`: parallel lists of the tokens, their log probabilities, a
    {text: log probability} map of the most likely tokens each, and each token's offset in the choice's text, the
    first at `offset`."""
    offsets = []
    for text, _, _ in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in tokens],
        "token_logprobs": [lp for _, lp, _ in tokens],
        "top_logprobs": [dict(top) for _, _, top in tokens],
        "text_offset": offsets,
    }


def usage_chunk_body(kind: Literal["chat", "text"], id: str, created: int, model: str, usage: dict[str, int]):
    """The last chunk of a stream with `stream_options: {"include_usage": true}`: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
