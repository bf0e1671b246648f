"""The two workloads of benchmarks/benchmark_serve_mixed.py that repeat text a server has seen, beside the independent
prompts of benchmarks/serve_workload.py: a shared system prompt and multi-turn chats. Both are made from text that
ships with the repository, so every machine builds the same requests; both go to `/v1/completions` as raw text (no
chat template, which would differ between engines).

- shared-prefix (`make_shared_prefix_workload`): every request is the same system prompt (the opening paragraphs of
  benchmarks/texts/legal.txt, 500-1000 tokens: `system_prefix_ids`), a blank line, then a prompt of the independent
  workload (a window of the story corpus, lengths around `--input-len`), sent at the same Poisson arrivals. A server
  with a prefix cache computes the system prompt once.
- multi-turn (`make_conversations`): C conversations of T turns; a conversation's user turns are consecutive lines
  of benchmarks/texts/dialogue.txt, its first turn sent at the arrival process's offset, each later turn only once
  the answer before it has completed (and `think_time` seconds after), its prompt the previous prompt, the answer
  the server gave and the next user turn (`next_turn_prompt`): each turn resends the conversation so far.

`build_workloads` makes every request of a benchmark run (each workload at each rate, and its warm-up), `send` sends
one such set to a started server.

Everything is drawn from seeded generators: every server gets the same system prompt, suffixes, user turns, answer
lengths and arrival offsets. A multi-turn prompt holds the server's own answers, so its text differs between servers
while its length in tokens does not (each answer is exactly its drawn length).

    prefix = system_prefix_ids(tokenizer.encode, system_text())
    items = make_shared_prefix_workload(prefix, corpus_ids, 24, 128, 64, 0.5, rate=2, seed=0,
                                        separator_ids=tuple(tokenizer.encode("\n\n")))
    chats = make_conversations(dialogue_utterances(), 6, turns=4, output_len=64, range_ratio=0.5, rate=2, seed=0)
    records = asyncio.run(run_conversations(url, "vaswani-int8", chats, {"ignore_eos": True}, count_tokens))
"""

import asyncio
import math
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.serve_workload import (
    RequestRecord,
    WorkItem,
    arrival_offsets,
    length_bounds,
    make_workload,
    one_request,
    run_workload,
    structured_schema,
    with_structured_share,
)

TEXTS = Path(__file__).resolve().parent / "texts"
WORKLOADS = ("independent", "shared-prefix", "multi-turn")
# The system prompt's length in tokens: at most PREFIX_TOKENS[1], at least PREFIX_TOKENS[0] (the 500-1000).
PREFIX_TOKENS = (500, 1000)


def system_text() -> str:
    """The text the shared system prompt is cut from: a services agreement, about 1000 of SmolLM2's tokens."""
    return (TEXTS / "legal.txt").read_text(encoding="utf-8")


def dialogue_utterances() -> list[str]:
    """benchmarks/texts/dialogue.txt as its utterances ("Maya: ...", "Tom: ..."), each one line: a speaker's line
    and the lines that continue it are joined by a space."""
    text = (TEXTS / "dialogue.txt").read_text(encoding="utf-8")
    utterances: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if re.match(r"^\w+: ", line) or not utterances:
            utterances.append(line.strip())
        else:
            utterances[-1] += " " + line.strip()
    return utterances


def system_prefix_ids(encode: Callable[[str], list[int]], text: str, most: int = PREFIX_TOKENS[1]) -> tuple[int, ...]:
    """The token ids of the shared system prompt: the longest run of `text`'s opening paragraphs that stays within
    `most` tokens. Whole paragraphs without the blank line after the last, so the prefix ends on a full stop, where
    the tokenizer starts a new token whatever follows: a cut inside a word, or trailing whitespace (tokenized
    differently once text follows it), would change the prefix's last tokens from one prompt to the next and break
    the sharing. `encode` is the tokenizer's text -> ids without special tokens. Raises when that leaves fewer than
    PREFIX_TOKENS[0] tokens."""
    paragraphs = [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]
    ids = []
    for count in range(1, len(paragraphs) + 1):
        longer = encode("\n\n".join(paragraphs[:count]))
        if len(longer) > most:
            break
        ids = longer
    if len(ids) < PREFIX_TOKENS[0]:
        raise ValueError(f"the system prompt has {len(ids)} tokens within {most}; it needs {PREFIX_TOKENS[0]} or more")
    return tuple(ids)


def make_shared_prefix_workload(
    prefix_ids: tuple[int, ...],
    corpus_ids: list[int],
    count: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rate: float,
    seed: int,
    burstiness: float = 1.0,
    separator_ids: tuple[int, ...] = (),
) -> list[WorkItem]:
    """The independent workload (`make_workload`, same arguments, same draws) with `prefix_ids` and then
    `separator_ids` (the benchmark's: a blank line) in front of every prompt: the prompts share exactly that prefix,
    their suffixes are the usual corpus windows."""
    items = make_workload(corpus_ids, count, input_len, output_len, range_ratio, rate, seed, burstiness)
    shared = tuple(prefix_ids) + tuple(separator_ids)
    return [replace(item, prompt_ids=shared + item.prompt_ids) for item in items]


@dataclass(frozen=True)
class Conversation:
    """One multi-turn chat: the text of each user turn, the answer length asked for after each, when its first turn
    is sent (seconds after the run starts) and how long the client waits after an answer before the next turn."""

    user_turns: tuple[str, ...]
    output_lens: tuple[int, ...]
    offset: float
    think_time: float = 0.0


def make_conversations(
    utterances: list[str],
    count: int,
    turns: int,
    output_len: int,
    range_ratio: float,
    rate: float,
    seed: int,
    burstiness: float = 1.0,
    think_time: float = 0.0,
    lines_per_turn: tuple[int, int] = (1, 3),
) -> list[Conversation]:
    """`count` conversations of `turns` turns each: a user turn is `lines_per_turn` consecutive utterances (drawn
    uniformly in that inclusive range) from a random start, each conversation's turns following each other in the
    dialogue from its own start (wrapping around); answer lengths as the independent workload's (`length_bounds`);
    first turns sent at `arrival_offsets` (a generator of its own, as `make_workload`'s). Each user turn ends with a
    newline, so the answer starts on a line of its own."""
    if turns < 1 or count < 1:
        raise ValueError("a multi-turn workload needs at least one conversation of one turn.")
    out_low, out_high = length_bounds(output_len, range_ratio)
    rng = random.Random(seed)
    conversations = []
    offsets = arrival_offsets(random.Random(seed + 1), count, rate, burstiness)
    for offset in offsets:
        position, user_turns = rng.randrange(len(utterances)), []
        for _ in range(turns):
            lines = rng.randint(*lines_per_turn)
            user_turns.append("\n".join(utterances[(position + k) % len(utterances)] for k in range(lines)) + "\n")
            position += lines
        output_lens = tuple(rng.randint(out_low, out_high) for _ in range(turns))
        conversations.append(Conversation(tuple(user_turns), output_lens, offset, think_time))
    return conversations


def next_turn_prompt(prompt: str, answer: str, user_turn: str) -> str:
    """The prompt of a conversation's next turn: the conversation so far (the previous turn's prompt and the answer
    it got), a line break, then the next user turn."""
    return prompt + answer + "\n" + user_turn


def conversation_prompts(conversation: Conversation, answers: list[str]) -> list[str]:
    """Every turn's prompt of `conversation`, given the answers of all turns but the last (what `run_conversations`
    sends, turn by turn, with the answers the server gives)."""
    prompts = [conversation.user_turns[0]]
    for answer, user_turn in zip(answers, conversation.user_turns[1:]):
        prompts.append(next_turn_prompt(prompts[-1], answer, user_turn))
    return prompts


async def converse(http, model, conversation, fixed_length, count_tokens, start) -> list[RequestRecord]:
    """One conversation, turn after turn; a failed turn ends it (the turns left are recorded as failed, not sent)."""
    await asyncio.sleep(max(0.0, start + conversation.offset - time.perf_counter()))
    records: list[RequestRecord] = []
    prompt = conversation.user_turns[0]
    for turn, (user_turn, output_len) in enumerate(zip(conversation.user_turns, conversation.output_lens)):
        if turn:
            if records[-1].error is not None:
                sent = time.perf_counter()
                records.append(RequestRecord(sent, [], 0, output_len, error="not sent: an earlier turn failed"))
                continue
            await asyncio.sleep(conversation.think_time)
            prompt = next_turn_prompt(prompt, records[-1].text, user_turn)
        item = WorkItem((), output_len, 0.0)
        record = await one_request(http, model, prompt, item, count_tokens(prompt), fixed_length, time.perf_counter())
        records.append(record)
    return records


async def run_conversations(
    url: str, model: str, conversations: list[Conversation], fixed_length: dict, count_tokens: Callable[[str], int]
) -> list[RequestRecord]:
    """Every conversation against the server at `url`, each started at its offset; the records of all turns,
    conversation by conversation (turn order within each)."""
    import httpx

    limits = httpx.Limits(max_connections=len(conversations) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        per_conversation = await asyncio.gather(
            *(converse(http, model, chat, fixed_length, count_tokens, start) for chat in conversations)
        )
    return [record for records in per_conversation for record in records]


# ------------------------------------------------------------------------------------------------ the benchmark's requests


def build_workloads(args, tokenizer, stories: list[str]) -> tuple[dict, dict]:
    """Every request the run sends, keyed "WORKLOAD RATE" (and "WORKLOAD warm-up"; "... structured" for the
    structured mix): ("requests", items, texts, prompt token counts) or ("conversations", conversations); and what
    the results say of each workload (token counts)."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    corpus_ids = encode("\n\n".join(stories))
    prefix = system_prefix_ids(encode, system_text(), args.prefix_tokens)
    separator = tuple(encode("\n\n"))
    utterances = dialogue_utterances()
    schema = structured_schema(length_bounds(args.output_len, args.range_ratio)[1])
    made, described = {}, {}
    # Every rate (and the warm-up) gets prompts of its own, drawn with a seed of its own: a server that keeps the
    # KV cache of prompts it has seen (llama-server, vLLM's prefix caching) would otherwise answer a rate's prompts
    # from the cache of the rate before. Only the shared-prefix workload's system prompt is the same throughout.
    for name in args.workloads:
        # Each workload is warmed up with two requests of its own (a shared prefix as a deployed server's system
        # prompt would be; multi-turn with two independent prompts).
        for index, rate in enumerate(["warm-up", *args.rates]):
            count, arrival = (2, math.inf) if rate == "warm-up" else (args.num_prompts, rate)
            seed = args.seed + 1000 * index
            if name == "multi-turn" and rate != "warm-up":
                chats = make_conversations(
                    utterances, args.conversations or max(1, args.num_prompts // args.turns), args.turns,
                    args.output_len, args.range_ratio, rate, seed, args.burstiness, args.think_time,
                )  # fmt: skip
                made[f"{name} {rate}"] = ("conversations", chats)
                continue
            draw = (args.input_len, args.output_len, args.range_ratio, arrival, seed, args.burstiness)
            if name == "shared-prefix":
                items = make_shared_prefix_workload(prefix, corpus_ids, count, *draw, separator)
            else:
                items = make_workload(corpus_ids, count, *draw)
            texts = [tokenizer.decode(item.prompt_ids) for item in items]
            counts = [len(encode(text)) for text in texts]
            made[f"{name} {rate}"] = ("requests", items, texts, counts)
            if args.structured_share and name == "independent":  # a share with the one schema (the warm-up compiles it)
                share = 0.5 if rate == "warm-up" else args.structured_share
                mixed = with_structured_share(items, share, seed, schema)
                made[f"{name} {rate} structured"] = ("requests", mixed, texts, counts)
        measured = [count for key, (kind, *parts) in made.items() if key.startswith(name + " ") and kind == "requests"
                    and "warm-up" not in key for count in parts[2]]  # fmt: skip
        described[name] = {"prompt_tokens_mean": statistics.mean(measured)} if measured else {}
    if "shared-prefix" in args.workloads:
        described["shared-prefix"]["prefix_tokens"] = len(prefix)
    if "multi-turn" in args.workloads:
        described["multi-turn"] = {"conversations": args.conversations or max(1, args.num_prompts // args.turns)}
    return made, described


def send(server, engine: str, sent: tuple, count_tokens) -> list:
    kind, *parts = sent
    if kind == "conversations":
        chats = parts[0]
        return asyncio.run(run_conversations(server.url, engine, chats, server.fixed_length, count_tokens))
    return asyncio.run(run_workload(server.url, engine, *parts, server.fixed_length))


def chat_prompt_lengths(runs: list[dict], turns: int) -> dict:
    """The mean prompt tokens of the multi-turn requests sent so far, and of the last turns alone (the prompts grow
    with the answers, so they are known only once sent)."""
    sent = [request for run in runs if run.get("workload") == "multi-turn" for request in run["requests"]]
    every = [request["prompt_tokens"] for request in sent if request["error"] is None]
    last = [
        request["prompt_tokens"] for i, request in enumerate(sent) if i % turns == turns - 1 and not request["error"]
    ]
    return {"prompt_tokens_mean": statistics.mean(every) if every else math.nan,
            "last_turn_tokens_mean": statistics.mean(last) if last else math.nan}  # fmt: skip
