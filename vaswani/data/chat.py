"""Chat data for supervised fine-tuning: conversations in the messages format, rendered with the tokenizer's chat
template, with labels only on the assistant's turns.

A conversation is a list of `{"role": ..., "content": ...}` messages, as chat datasets store them in JSON lines
(`{"messages": [...]}` per line). `chat_example` renders it with `tokenizer.apply_chat_template` and labels the
tokens the assistant wrote (its content and the template's end-of-turn marker); every other token, the template's
role headers and the user's and system's turns, gets the label -100, which the loss ignores.

Example:
    >>> from vaswani.data.chat import chat_example, chat_tokenizer
    >>> from vaswani.data import corpus_stories
    >>> tokenizer = chat_tokenizer(corpus_stories()[:200], vocab_size=300)
    >>> example = chat_example(tokenizer, [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}])
    >>> tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])
    'Hello.<|im_end|>\\n'
"""

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .tokenization import train_tokenizer

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy (and so every transformers loss) skips
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ROLES = ("system", "user", "assistant", "tool")

# ChatML, the format of many open chat models. The `generation` block marks what the assistant writes, for
# transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`; it changes nothing in the rendered text.
# Tools follow the Hermes convention (as Qwen's templates do, so `vaswani serve` reads calls with its "hermes" parser):
# given `tools`, the first turn is a system turn that holds the conversation's system message, if any, lists the
# tools inside <tools></tools> and shows the <tool_call> block to answer with; an assistant's `tool_calls` are written
# as those blocks (arguments as JSON, or as given when they are text) and a tool's result comes back as a user turn
# inside <tool_response></tool_response>. Without tools and tool calls the text is plain ChatML, as before.
CHATML_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call the functions described by these JSON schemas:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as a JSON object in a <tool_call> block "
    '(one block per call):\\n<tool_call>\\n{"name": <function name>, "arguments": <arguments object>}\\n'
    "</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] or '' -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (function.name | tojson) + ', \"arguments\": ' -}}"
    "{{- function.arguments if function.arguments is string else function.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endgeneration -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_tokenizer(texts: Iterable[str], vocab_size: int = 1000, **kwargs) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (`vaswani.data.tokenization.train_tokenizer`, `**kwargs` passed on),
    with ChatML's `<|im_start|>`/`<|im_end|>` added as special tokens and `CHATML_TEMPLATE` as its chat template.

    End-of-sequence is `<|im_end|>`, so `generate` stops where the assistant's turn ends. The vocabulary is
    `vocab_size + 2` tokens: size the model with `len(tokenizer)`.

    Example:
        >>> tokenizer = chat_tokenizer(["a tiny corpus", "of two documents"], vocab_size=300)
        >>> tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
        '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    tokenizer = train_tokenizer(texts, vocab_size, **kwargs)
    tokenizer.add_tokens([IM_START, IM_END], special_tokens=True)
    tokenizer.eos_token = IM_END
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def check_conversation(messages: object) -> list[dict]:
    """`messages` if it is a conversation the script can train on, else a ValueError that says what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"A conversation must be a non-empty list of messages, got {type(messages).__name__}.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"Message {index} must be a dict with a string 'content', got {message!r}.")
        if message.get("role") not in ROLES:
            raise ValueError(f"Message {index} has role {message.get('role')!r}; use one of {', '.join(ROLES)}.")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError("A conversation has no assistant message, so nothing in it would be trained.")
    return messages


def assistant_character_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of what the assistant writes in it.

    The span of assistant turn i runs from the end of the conversation before it, rendered with the generation
    prompt (the header the model is given), to the end of the conversation up to and including it: the content and
    the template's end-of-turn marker, which the model must learn to write so that generation stops.
    """
    if tokenizer.chat_template is None:
        raise ValueError(
            "The tokenizer has no chat template, so conversations cannot be rendered: fine-tune from a chat model's "
            "tokenizer, pass --tokenizer DIR, or set tokenizer.chat_template."
        )

    def render(turns: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)

    text = render(messages, add_generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], add_generation_prompt=True), render(messages[: index + 1], False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ValueError(
                "The chat template renders earlier turns differently once later ones follow (it is not "
                "prefix-stable), so the assistant's turns cannot be located: use a template that renders each turn "
                "the same way whatever follows it."
            )
        spans.append((len(before), len(through)))
    return text, spans


def chat_example(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int | None = None) -> dict:
    """One conversation as `input_ids`, `attention_mask` and `labels` (the input ids on the assistant's tokens,
    -100 elsewhere), cut to `max_length` tokens.

    Tokens are matched to the assistant's character spans through the tokenizer's offsets: a token belongs to the
    assistant when it starts inside a span. The rendered text is tokenized as `apply_chat_template` tokenizes it
    (no special tokens added), so the ids are those the model sees at inference.
    """
    text, spans = assistant_character_spans(tokenizer, check_conversation(messages))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoding["input_ids"]
    labels = [
        token if any(start <= token_start < end for start, end in spans) else IGNORE_INDEX
        for token, (token_start, _) in zip(input_ids, encoding["offset_mapping"])
    ]
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


__all__ = [
    "CHATML_TEMPLATE",
    "IGNORE_INDEX",
    "assistant_character_spans",
    "chat_example",
    "chat_tokenizer",
    "check_conversation",
]
