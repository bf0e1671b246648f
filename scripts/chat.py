"""Chat with a saved chat model: a PyTorch folder (vaswani or any transformers causal LM) or an ONNX export
(`vaswani export --task text-generation`), through the text-generation pipeline and through `generate`.

The message is rendered with the tokenizer's chat template; the reply is greedy unless `--sample`. Both paths are
timed, and the script says whether they wrote the same reply.

    python scripts/chat.py --model outputs/chat-lora/model "Tell me a story."
    python scripts/chat.py --model outputs/chat-onnx --system "You tell short stories for children." "Tell me a story."
"""

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import vaswani  # noqa: F401  (registers the vaswani classes with the Auto classes)


def load_chat_model(folder: Path):
    """An `OrtModelForCausalLM` for an ONNX export (a folder with manifest.json), else a PyTorch causal LM."""
    if (folder / "manifest.json").is_file():
        from vaswani.conversion import OrtModelForCausalLM

        return OrtModelForCausalLM.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("message", help="the user's message")
    parser.add_argument("--model", type=Path, required=True, help="a model folder or an ONNX export folder")
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (top-k 50, temperature 0.7) instead of greedy")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.chat_template is None:
        raise SystemExit(f"error: {args.model} has no chat template; it is not a chat model's folder.")
    model = load_chat_model(args.model)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}
    ]
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        options.update(top_k=50, temperature=0.7)

    chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
    start = time.perf_counter()
    reply = chat(messages, **options)[0]["generated_text"][-1]["content"]
    pipeline_seconds = time.perf_counter() - start
    print(f"pipeline ({pipeline_seconds:.2f} s): {reply}")

    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    start = time.perf_counter()
    tokens = model.generate(**prompt, **options, pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    new_tokens = tokens[0, prompt["input_ids"].shape[1] :]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"generate ({len(new_tokens)} tokens in {seconds:.2f} s, {len(new_tokens) / seconds:.1f} tokens/s): {text}")
    if not args.sample:
        print("pipeline and generate agree" if text == reply else "pipeline and generate differ")


if __name__ == "__main__":
    main()
