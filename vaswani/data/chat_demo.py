"""The chat journey's demo: build a small LLaMA chat checkpoint and a conversations file locally, to try the chat fine-tuning journey offline.

The checkpoint is a transformers `LlamaForCausalLM` with random weights and a byte-level BPE tokenizer trained on the
packaged corpus, with ChatML special tokens and chat template (`vaswani.data.chat.chat_tokenizer`): the same folder layout
as a real chat model, so `vaswani convert` takes it. The conversations are JSON lines in the messages format, two
turns each, made from the corpus stories: the user asks for a story, the assistant tells its beginning; the user asks
how it ends, the assistant tells its last sentence.

    python -m vaswani.data.chat_demo --output outputs/chat-llama --conversations outputs/chats.jsonl
"""

import argparse
import json
import re
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from . import corpus_stories
from .chat import chat_tokenizer

SYSTEM_PROMPT = "You tell short stories for children."


def build_chat_checkpoint(
    folder: str | Path,
    vocab_size: int = 1000,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Save a random-weight `LlamaForCausalLM` chat model (GQA, RoPE, tied embeddings) and its chat tokenizer."""
    tokenizer = chat_tokenizer(corpus_stories(), vocab_size=vocab_size, model_max_length=max_position_embeddings)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def story_conversations(count: int, offset: int = 0) -> list[dict]:
    """`count` two-turn conversations from the corpus stories, starting at story `offset`."""
    conversations = []
    for story in corpus_stories()[offset : offset + count]:
        sentences = re.split(r"(?<=[.!?]) (?=[A-Z\"])", story)
        beginning, ending = " ".join(sentences[:3]), sentences[-1]
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": beginning},
            {"role": "user", "content": "How does it end?"},
            {"role": "assistant", "content": ending},
        ]
        conversations.append({"messages": messages})
    return conversations


def write_conversations(path: str | Path, count: int, offset: int = 0) -> Path:
    """Write `story_conversations(count, offset)` as JSON lines, one `{"messages": [...]}` per line."""
    rows = story_conversations(count, offset)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    """`python -m vaswani.data.chat_demo [--output DIR] [--conversations FILE] ...` (see `--help`)."""
    parser = argparse.ArgumentParser(prog="python -m vaswani.data.chat_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("outputs/chat-llama"), help="the checkpoint folder")
    parser.add_argument("--conversations", type=Path, default=Path("outputs/chats.jsonl"), help="training file")
    parser.add_argument("--validation", type=Path, default=Path("outputs/chats-valid.jsonl"), help="held-out file")
    parser.add_argument("--count", type=int, default=200, help="training conversations (held-out: a fifth)")
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    build_chat_checkpoint(args.output, args.vocab_size, args.hidden_size, args.layers)
    write_conversations(args.conversations, args.count)
    write_conversations(args.validation, max(args.count // 5, 1), offset=args.count)
    print(f"chat checkpoint: {args.output}; conversations: {args.conversations}, {args.validation}")


if __name__ == "__main__":
    main()
