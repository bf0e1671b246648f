"""`vaswani chat FOLDER`: chat with a causal LM folder (PyTorch or ONNX export) through its chat template.

Interactive without `--prompt`: lines from stdin, the answer's tokens streamed as they are generated, the history kept
across turns (`/reset` clears it, `/exit` or end of input ends). With `--prompt TEXT`: one answer, and nothing else, on
stdout. Greedy unless `--temperature` > 0. `--json-schema FILE` keeps every answer inside a JSON schema.

    $ vaswani chat outputs/chat-onnx --system "You tell short stories for children." --prompt "Tell me a story."
    $ vaswani chat outputs/chat-onnx --json-schema person.schema.json --prompt "Describe a person."

From Python:

    >>> from vaswani.cli.chat import ChatOptions, chat_reply
    >>> from vaswani.runtime.loading import load_folder
    >>> loaded = load_folder("outputs/chat-onnx", task="text-generation")
    >>> chat_reply(loaded, [{"role": "user", "content": "Tell me a story."}], ChatOptions(max_new_tokens=32))
    'Once upon a time ...'
"""

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from .options import add_runtime_arguments

if TYPE_CHECKING:
    from ..constraints import Grammar
    from ..runtime.loading import LoadedFolder

Messages = list[dict[str, str]]


@dataclass
class ChatOptions:
    """How an answer is generated: greedy when `temperature` is 0, else sampled with `top_p`/`top_k` (None: off),
    drawing as after `torch.manual_seed(seed)` when `seed` is given (the caller's random state is left as it was);
    kept inside `grammar` when one is given (`vaswani.constraints.Grammar`)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    grammar: "Grammar | None" = None  # a constraint on every answer (`--json-schema FILE`)

    def generate_kwargs(self) -> dict:
        """The keyword arguments of `generate` these options stand for."""
        if self.temperature <= 0:
            return dict(max_new_tokens=self.max_new_tokens, do_sample=False)
        # top_k=0 and top_p=1.0 switch those processors off (a model's generation_config may set its own otherwise).
        return dict(
            max_new_tokens=self.max_new_tokens,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k if self.top_k is not None else 0,
        )


@contextmanager
def seeded(seed: int | None, device: Any) -> Iterator[None]:
    """Sampling inside draws from torch's generator seeded with `seed` (None: as it stands), as after
    `torch.manual_seed(seed)`; the caller's generator state is restored afterwards."""
    if seed is None:
        yield
        return
    import torch

    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def chat_prompt(loaded: "LoadedFolder", messages: Messages) -> dict:
    """The conversation rendered by the folder's chat template, as `generate`'s inputs (a batch of one)."""
    if loaded.tokenizer.chat_template is None:
        raise ValueError(
            f"{loaded.folder}'s tokenizer has no chat template, so a conversation cannot be rendered: use a chat "
            "model's folder, or set tokenizer.chat_template and save the tokenizer into the folder."
        )
    return loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(loaded.model.device)


def chat_reply(
    loaded: "LoadedFolder",
    messages: Messages,
    options: ChatOptions | None = None,
    stream: Callable[[str], None] | None = None,
) -> str:
    """The assistant's answer to `messages` (a list of {"role", "content"}) from a text-generation folder loaded by
    `vaswani.runtime.loading.load_folder`; `stream` gets the answer's text piece by piece as it is generated."""
    from transformers import TextStreamer

    if loaded.task != "text-generation":
        raise ValueError(f"{loaded.folder} holds a {loaded.task!r} model; chat needs a text-generation one.")
    options = options or ChatOptions()
    prompt = chat_prompt(loaded, messages)
    streamer = None
    if stream is not None:
        streamer = TextStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer.on_finalized_text = lambda text, stream_end=False: stream(text)
    pad_token_id = loaded.tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = loaded.tokenizer.eos_token_id
    processors = [answer_constraint(loaded, options.grammar)] if options.grammar is not None else []
    with seeded(options.seed, loaded.model.device):
        tokens = loaded.model.generate(
            **prompt,
            **options.generate_kwargs(),
            streamer=streamer,
            pad_token_id=pad_token_id,
            logits_processor=processors,
        )
    return loaded.tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def answer_constraint(loaded: "LoadedFolder", grammar: "Grammar"):
    """The logits processor that keeps the folder's answers inside `grammar`, ending them with the model's own
    end-of-sequence ids (those of its generation config)."""
    from ..constraints import GrammarLogitsProcessor

    ends = loaded.model.generation_config.eos_token_id
    return GrammarLogitsProcessor(grammar, loaded.tokenizer, ends, vocab_size=loaded.model.config.vocab_size)


def chat_session(
    loaded: "LoadedFolder",
    options: ChatOptions,
    system: str | None = None,
    lines: TextIO = sys.stdin,
    output: TextIO = sys.stdout,
) -> None:
    """The interactive chat: each line of `lines` is a user turn, answered with streamed tokens on `output`; the
    conversation is kept across turns. `/reset` starts a new one, `/exit` or the end of input ends."""
    interactive = lines.isatty()
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        if interactive:
            output.write("> ")
            output.flush()
        line = lines.readline()
        if not line or line.strip() == "/exit":
            return
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            messages = list(start)
            continue

        def write(piece: str) -> None:
            output.write(piece)
            output.flush()

        messages.append({"role": "user", "content": text})
        answer = chat_reply(loaded, messages, options, stream=write)
        output.write("\n")
        output.flush()
        messages.append({"role": "assistant", "content": answer})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `vaswani chat`."""
    parser.add_argument("folder", metavar="FOLDER", help="a chat model's folder: PyTorch, or an ONNX export")
    parser.add_argument("--prompt", help="answer this one message, print the answer alone on stdout, and exit")
    parser.add_argument("--system", help="the system message that starts the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, help="with --temperature: nucleus sampling's probability mass")
    parser.add_argument("--top-k", type=int, help="with --temperature: sample from the K likeliest tokens")
    parser.add_argument("--seed", type=int, help="with --temperature: the random seed, for repeatable answers")
    parser.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON valid under the JSON schema in FILE (constrained decoding, as vaswani serve's "
        "response_format json_schema)",
    )
    add_runtime_arguments(parser)


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values no answer can be generated with (argparse's error: usage, message, exit status 2)."""
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy) or more")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error("--top-p must be in (0, 1]")
    if args.top_k is not None and args.top_k < 1:
        parser.error("--top-k must be at least 1")
    if args.temperature == 0:
        for flag, value in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed)):
            if value is not None:
                parser.error(f"{flag} applies to sampling: add --temperature T (T > 0; without it answers are greedy)")


def json_schema_grammar(path: str) -> "Grammar":
    """The constraint of `--json-schema FILE`: the JSON schema the file holds."""
    from pathlib import Path

    from ..constraints import Grammar

    return Grammar.json_schema(Path(path).read_text())


def run(args: argparse.Namespace) -> int:
    """`vaswani chat`: 0 when the chat ended normally, 2 for a folder that cannot chat."""
    check_arguments(args.parser, args)
    from ..runtime.loading import load_folder, set_command_threads

    try:
        loaded = load_folder(
            args.folder, args.device, args.threads, "text-generation", args.engine, args.openvino_precision
        )
        if loaded.tokenizer.chat_template is None:
            chat_prompt(loaded, [])  # raises the error that names the fix
    except (ValueError, OSError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        grammar = json_schema_grammar(args.json_schema) if args.json_schema else None
        if grammar is not None:
            answer_constraint(loaded, grammar)  # compiled now (and cached): a schema it cannot enforce ends here
    except (ValueError, OSError, ImportError) as error:
        print(f"error: --json-schema: {error}", file=sys.stderr)
        return 2
    options = ChatOptions(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed, grammar)
    set_command_threads("model" if loaded.form == "pytorch" else "small-ops", args.threads)
    if args.prompt is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        print(chat_reply(loaded, messages, options))
    else:
        chat_session(loaded, options, args.system)
    return 0
