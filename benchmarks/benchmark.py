"""Side-by-side speed of vaswani and transformers' own models at the reference shapes.

Each pair holds the same weights (vaswani's is converted from the transformers model), runs with the same
attention backend, and is timed alternately in one process so machine drift hits both equally. Figures are
medians of `--repeats` runs after a warm-up; the ratio is vaswani's time over the reference's (below 1.0:
vaswani is faster).

    python -m benchmarks.benchmark                               # all families, 2 CPU threads, fp32
    python -m benchmarks.benchmark --family decoder --markdown benchmark.md
    python -m benchmarks.benchmark --batch 2 --seq 128 --new-tokens 32 --repeats 5 \
        --json docs/results/benchmark_cpu.json --markdown docs/results/benchmark_cpu.md  # the published page
    python -m benchmarks.benchmark --device cuda --dtype bfloat16 --static-cache  # GPU, compiled static cache

With `--json`, the raw medians and the tables go to that file and `--markdown` is rendered from it
(benchmarks/results/). Shapes: LLaMA-shaped decoder (21.8M parameters) vs `LlamaForCausalLM`; BART-shaped
encoder-decoder (49.3M) vs `BartForConditionalGeneration`; a 4-layer BERT-base-wide encoder vs `BertModel`.
"""

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from benchmarks.provenance import command_line, machine
from benchmarks.results.pages import TABLE_MAKERS, write
from vaswani.conversion.checkpoints import from_transformers

VOCAB = 8000
LLAMA_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
BART_SHAPE = dict(
    vocab_size=VOCAB,
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=8,
    decoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_ffn_dim=2048,
    max_position_embeddings=1024,
    dropout=0.0,
)
BERT_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=768,
    num_hidden_layers=4,
    num_attention_heads=12,
    intermediate_size=3072,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


@dataclass
class Row:
    label: str
    reference_seconds: float
    vaswani_seconds: float
    tokens: int = 0  # > 0: also report tokens/s


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_alternating(tasks: dict[str, Callable[[], None]], repeats: int, device: str) -> dict[str, float]:
    """Median wall time of each task, run in turn (A, B, A, B, ...) after one untimed warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in tasks}
    for round_index in range(1 + repeats):
        for name, task in tasks.items():
            synchronize(device)
            start = time.perf_counter()
            task()
            synchronize(device)
            if round_index:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def prepare_pair(reference: PreTrainedModel, args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedModel]:
    reference = reference.eval()
    ours = from_transformers(reference)
    for model in (reference, ours):
        model.set_attn_implementation(args.attn)
        model.to(device=args.device, dtype=getattr(torch, args.dtype))
    return reference, ours


def forward_task(model: PreTrainedModel, inputs: dict) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            model(**inputs)

    return run


def training_task(model: PreTrainedModel, inputs: dict) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def run() -> None:
        model.train()
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()

    return run


def generate_task(model: PreTrainedModel, prompt: torch.Tensor, args: argparse.Namespace, beams: int = 1) -> Callable[[], None]:
    # transformers compiles the decode step by itself when the cache is static and the device is a GPU.
    extra = {"cache_implementation": "static"} if args.static_cache else {}

    def run() -> None:
        with torch.no_grad():
            output = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                num_beams=beams,
                do_sample=False,
                pad_token_id=model.config.pad_token_id or 0,
                **extra,
            )
        assert output.shape[-1] >= args.new_tokens

    return run


def compare(
    label: str, pair: tuple[PreTrainedModel, PreTrainedModel], make_task: Callable, args: argparse.Namespace, tokens: int = 0
) -> Row:
    reference, ours = pair
    medians = time_alternating({"reference": make_task(reference), "vaswani": make_task(ours)}, args.repeats, args.device)
    row = Row(label, medians["reference"], medians["vaswani"], tokens)
    print(f"  {label}: reference {row.reference_seconds * 1e3:.1f} ms, vaswani {row.vaswani_seconds * 1e3:.1f} ms", flush=True)
    return row


def random_ids(*shape: int, generator: torch.Generator, device: str) -> torch.Tensor:
    # Ids from 3 up: never a special token, so generation runs its full length.
    return torch.randint(3, VOCAB, shape, generator=generator).to(device)


def max_logit_diff(pair: tuple[PreTrainedModel, PreTrainedModel], inputs: dict) -> float:
    with torch.no_grad():
        outputs = [model(**inputs) for model in pair]
    field = "logits" if "logits" in outputs[0] else "last_hidden_state"
    return (outputs[0][field].float() - outputs[1][field].float()).abs().max().item()


def bench_decoder(args: argparse.Namespace, generator: torch.Generator) -> tuple[str, list[Row]]:
    torch.manual_seed(0)
    pair = prepare_pair(LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)), args)
    batch = random_ids(args.batch, args.seq, generator=generator, device=args.device)
    prompt = random_ids(1, args.prompt, generator=generator, device=args.device)
    diff = max_logit_diff(pair, {"input_ids": batch[:1, :64]})
    rows = [
        compare(f"forward, {args.batch} x {args.seq}", pair, lambda m: forward_task(m, {"input_ids": batch}), args),
        compare(
            f"training step, {args.batch} x {args.seq}",
            pair,
            lambda m: training_task(m, {"input_ids": batch, "labels": batch}),
            args,
        ),
        compare(
            f"greedy generate, 1 x {args.prompt} + {args.new_tokens}",
            pair,
            lambda m: generate_task(m, prompt, args),
            args,
            tokens=args.new_tokens,
        ),
    ]
    return f"LLaMA-shaped decoder vs `LlamaForCausalLM` (max abs logit diff {diff:.1e})", rows


def bench_seq2seq(args: argparse.Namespace, generator: torch.Generator) -> tuple[str, list[Row]]:
    torch.manual_seed(0)
    pair = prepare_pair(BartForConditionalGeneration(BartConfig(**BART_SHAPE)), args)
    source = random_ids(args.batch, args.seq, generator=generator, device=args.device)
    target = random_ids(args.batch, args.seq // 2, generator=generator, device=args.device)
    prompt = random_ids(1, args.prompt, generator=generator, device=args.device)
    diff = max_logit_diff(pair, {"input_ids": source[:1, :64], "labels": target[:1, :16]})
    train_inputs = {"input_ids": source, "labels": target}
    rows = [
        compare(
            f"forward, {args.batch} x {args.seq} -> {args.seq // 2}",
            pair,
            lambda m: forward_task(m, {"input_ids": source, "decoder_input_ids": target}),
            args,
        ),
        compare(f"training step, {args.batch} x {args.seq} -> {args.seq // 2}", pair, lambda m: training_task(m, train_inputs), args),
        compare(
            f"greedy generate, 1 x {args.prompt} -> {args.new_tokens}",
            pair,
            lambda m: generate_task(m, prompt, args),
            args,
            tokens=args.new_tokens,
        ),
        compare(
            f"4-beam generate, 1 x {args.prompt} -> {args.new_tokens}",
            pair,
            lambda m: generate_task(m, prompt, args, beams=4),
            args,
            tokens=args.new_tokens,
        ),
    ]
    return f"BART-shaped encoder-decoder vs `BartForConditionalGeneration` (max abs logit diff {diff:.1e})", rows


def bench_encoder(args: argparse.Namespace, generator: torch.Generator) -> tuple[str, list[Row]]:
    torch.manual_seed(0)
    pair = prepare_pair(BertModel(BertConfig(**BERT_SHAPE)), args)
    batch = random_ids(args.batch, 128, generator=generator, device=args.device)
    diff = max_logit_diff(pair, {"input_ids": batch[:1]})
    rows = [compare(f"forward, {args.batch} x 128", pair, lambda m: forward_task(m, {"input_ids": batch}), args)]
    return f"BERT-base-wide 4-layer encoder vs `BertModel` (max abs hidden-state diff {diff:.1e})", rows


FAMILIES = {"decoder": bench_decoder, "seq2seq": bench_seq2seq, "encoder": bench_encoder}


def markdown_table(title: str, rows: list[Row]) -> str:
    """One family's table as the page shows it (computed by results.side_by_side_tables from the raw medians)."""
    (made,) = TABLE_MAKERS["side_by_side"]({title: [asdict(row) for row in rows]}, {})
    lines = [f"**{title}**", "", "| " + " | ".join(made["columns"]) + " |", "|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in made["rows"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the reference machine has 2)")
    parser.add_argument("--attn", default="sdpa", help="attention backend for both models")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--static-cache", action="store_true", help="generate with a static cache (compiled on GPU)")
    parser.add_argument("--markdown", help="also write the tables to this file (rendered from --json when given)")
    parser.add_argument("--json", type=Path, help="write the raw medians and the tables to this JSON file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    header = (
        f"{args.device} {args.dtype}, {args.threads} threads, attn={args.attn}"
        f"{', static cache' if args.static_cache else ''}, torch {torch.__version__}; medians of {args.repeats}"
    )
    tables, families = [header], []
    for name in FAMILIES if args.family == "all" else [args.family]:
        print(f"{name}:", flush=True)
        title, rows = FAMILIES[name](args, generator)
        tables.append(markdown_table(title, rows))
        families.append((title, rows))
    report = "\n\n".join(tables)
    print("\n" + report)
    if args.json:
        command = command_line()
        results = {
            "title": "vaswani against transformers' own models, side by side",
            "command": command,
            "machine": machine(args.threads if args.device == "cpu" else None),
            "notes": [
                header + ". Each pair (same weights, same attention backend) is timed alternately in one process, "
                "so drift hits both; below 1.0, vaswani is faster."
            ],
            # The page's tables are computed from these medians when it is rendered (results.side_by_side_tables).
            "tables_from": "side_by_side",
            "raw": {title: [asdict(row) for row in rows] for title, rows in families},
        }
        write(results, args.json, args.markdown)
    elif args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(report + "\n")


if __name__ == "__main__":
    main()
