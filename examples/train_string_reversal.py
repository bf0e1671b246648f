"""String reversal: the textbook's encoder-decoder experiment, reproduced with transformers' `Trainer`.

A small 2017-style Transformer (post-LN, ReLU, sinusoidal positions; d_model 96, 4 heads, d_ff 192, 2 encoder and
2 decoder layers) learns to write random lowercase strings of length 3 to 10 backwards, one character per token.
The textbook reports a teacher-forced per-token accuracy of 100% at lengths 3, 5, 7 and 10, and 8% at length 15,
longer than any training string.

    python examples/train_string_reversal.py --threads 1    # the textbook setup: 4 minutes on one CPU core
    python examples/train_string_reversal.py --steps 300 --max-length 6 --output-dir /tmp/reversal  # a quick run

Writes to `--output-dir` (default `outputs/string_reversal`): the trained model (`model/`, safetensors),
`loss_curve.png`, `cross_attention.png` (every layer and head of the decoder's attention over the input),
`results.json` and `results.md`. Everything is seeded: two runs give the same numbers. `--json FILE` also writes
the results with the machine they ran on to FILE and renders FILE's page beside it (benchmarks/results/):

    python examples/train_string_reversal.py --threads 1 --json docs/results/string_reversal.json
"""

import argparse
import json
import math
import string
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, Trainer, TrainingArguments, set_seed

import vaswani  # noqa: F401  (registers the vaswani models with transformers' Auto classes)
from vaswani import VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig
from vaswani.training import TensorDataset, describe_device, save_loss_curve

# The character vocabulary: three special tokens, then one token per lowercase letter.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
VOCAB = (*SPECIAL_TOKENS, *string.ascii_lowercase)
TOKEN_IDS = {token: index for index, token in enumerate(VOCAB)}
PAD, BOS, EOS = (TOKEN_IDS[token] for token in SPECIAL_TOKENS)

EVAL_LENGTHS = (3, 5, 7, 10, 15)


@dataclass
class Args:
    output_dir: Path
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    min_length: int
    max_length: int
    eval_size: int
    eval_every: int
    seed: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    attention_text: str
    threads: int | None
    json: Path | None = None


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/string_reversal"))
    parser.add_argument("--steps", type=int, default=3500, help="optimizer steps, each on a batch of fresh strings")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak Adam learning rate")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup before the cosine decay")
    parser.add_argument("--min-length", type=int, default=3, help="shortest training string")
    parser.add_argument("--max-length", type=int, default=10, help="longest training string")
    parser.add_argument("--eval-size", type=int, default=1000, help="strings per evaluation (and per length)")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between validation-loss measurements")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=96, help="d_model")
    parser.add_argument("--num-layers", type=int, default=2, help="encoder layers, and as many decoder layers")
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=192, help="d_ff")
    parser.add_argument("--attention-text", default="algorithms", help="the input whose cross-attention is plotted")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: one per core); 1 is faster on a machine shared with other jobs",
    )
    parser.add_argument("--json", type=Path, help="also publish: the results as JSON here, and the page beside it")
    return Args(**vars(parser.parse_args(argv)))


# ------------------------------------------------------------------------------------------------------ data


def random_strings(count: int, min_length: int, max_length: int, generator: torch.Generator) -> list[str]:
    """`count` strings of uniformly random lowercase letters, with lengths uniform in [min_length, max_length]."""
    lengths = torch.randint(min_length, max_length + 1, (count,), generator=generator).tolist()
    letters = torch.randint(len(string.ascii_lowercase), (count, max_length), generator=generator).tolist()
    return ["".join(string.ascii_lowercase[i] for i in row[:length]) for row, length in zip(letters, lengths)]


def encode(texts: list[str]) -> dict[str, torch.Tensor]:
    """The model's inputs for a batch of strings: each string and its reversal, both closed by `</s>`.

    `input_ids` are right-padded with `<pad>` (masked out by `attention_mask`); `labels` are padded with -100,
    which the loss ignores. The model shifts `labels` right behind `<s>` to build the decoder's inputs.
    """
    width = max(map(len, texts)) + 1
    input_ids = torch.full((len(texts), width), PAD)
    labels = torch.full((len(texts), width), -100)
    for row, text in enumerate(texts):
        input_ids[row, : len(text) + 1] = torch.tensor([TOKEN_IDS[c] for c in text] + [EOS])
        labels[row, : len(text) + 1] = torch.tensor([TOKEN_IDS[c] for c in reversed(text)] + [EOS])
    return {"input_ids": input_ids, "attention_mask": (input_ids != PAD).long(), "labels": labels}


def decode(ids: list[int]) -> str:
    """Letters up to the first `</s>`; special tokens are dropped."""
    letters = []
    for token in ids:
        if token == EOS:
            break
        if token >= len(SPECIAL_TOKENS):
            letters.append(VOCAB[token])
    return "".join(letters)


# ----------------------------------------------------------------------------------------------------- model


def build_model(args: Args) -> VaswaniForConditionalGeneration:
    # The 2017 paper's shape (post-LN, ReLU, sinusoidal positions, one embedding matrix shared by encoder input,
    # decoder input and output, scaled by sqrt(d_model)), made small and without dropout.
    config = VaswaniSeq2SeqConfig.from_preset(
        "transformer-base",
        vocab_size=len(VOCAB),
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        encoder_layers=args.num_layers,
        decoder_layers=args.num_layers,
        hidden_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
    )
    return VaswaniForConditionalGeneration(config)


# ------------------------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def token_accuracy(model: VaswaniForConditionalGeneration, texts: list[str]) -> float:
    """Teacher-forced per-token accuracy: the fraction of target tokens (the reversed letters and the closing
    `</s>`) that the model's argmax predicts when it reads the correct previous tokens."""
    batch = encode(texts)
    predictions = model(**batch).logits.argmax(-1)
    scored = batch["labels"] != -100
    return (predictions[scored] == batch["labels"][scored]).float().mean().item()


@torch.no_grad()
def exact_match(model: VaswaniForConditionalGeneration, texts: list[str], batch_size: int = 500) -> float:
    """The fraction of strings whose greedy `generate` output is exactly the reversed string."""
    correct = 0
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        batch = encode(chunk)
        output = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            num_beams=1,
            max_new_tokens=max(map(len, chunk)) + 1,
        )
        correct += sum(decode(ids) == text[::-1] for ids, text in zip(output[:, 1:].tolist(), chunk))
    return correct / len(texts)


# ---------------------------------------------------------------------------------------------------- figures


@torch.no_grad()
def save_cross_attention(model: VaswaniForConditionalGeneration, text: str, path: Path) -> None:
    """Plot every decoder layer's and head's attention over the input while the model writes `text` reversed.

    Row t is the step that predicts the t-th output letter, so a head that finds the letter to copy draws the
    anti-diagonal: writing the first output letter reads the last input letter, and so on.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = encode([text])
    # Needs an attention implementation that returns its probabilities: the model is loaded with "eager".
    cross_attentions = model(**batch, output_attentions=True).cross_attentions  # layers x (1, heads, out, in)
    sources = [*text, "</s>"]
    targets = [*text[::-1], "</s>"]
    layers, heads = len(cross_attentions), cross_attentions[0].shape[1]
    fig, axes = plt.subplots(layers, heads, figsize=(2.6 * heads, 2.7 * layers), squeeze=False)
    for layer, attention in enumerate(cross_attentions):
        for head in range(heads):
            ax = axes[layer, head]
            ax.imshow(attention[0, head].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
            ax.set_xticks(range(len(sources)), sources, fontsize=7)
            ax.set_yticks(range(len(targets)), targets, fontsize=7)
            if layer == layers - 1:
                ax.set_xlabel("input token", fontsize=8)
            if head == 0:
                ax.set_ylabel("output token predicted", fontsize=8)
    fig.suptitle(f"Decoder cross-attention while reversing {text!r}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


COLUMNS = ["length", "teacher-forced token accuracy", "textbook", "greedy exact match"]
# The textbook's token accuracy (%) per string length: the reference the results page sets beside ours.
TEXTBOOK = {"3": 100, "5": 100, "7": 100, "10": 100, "15": 8}


def length_rows(results: dict) -> list[list[str]]:
    """The table's cells per evaluated length, beside the textbook's figure (benchmarks/results/quality.py's string_reversal_tables)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script run as a file: the benchmarks package
    from benchmarks.results.pages import TABLE_MAKERS

    return TABLE_MAKERS["string_reversal"]({"textbook": TEXTBOOK, **results}, {})[0]["rows"]


def publish(results: dict, json_path: Path) -> None:
    """The results page (docs/results/NAME.md) rendered from the JSON written beside it, with the machine."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script run as a file: the benchmarks package
    from benchmarks.provenance import machine
    from benchmarks.results.pages import write

    args = results["args"]
    page = {
        "title": "String reversal",
        "command": results["command"],
        "machine": machine(args["threads"] or torch.get_num_threads()),
        "notes": [
            f"Greedy `generate`, exact match on {results['eval_size']} fresh strings of length "
            f"{args['min_length']}-{args['max_length']}: **{results['exact_match']:.4f}** (target >= 0.99). "
            f"{results['eval_size']} fresh strings per length; token accuracy counts the reversed letters and the "
            "closing `</s>`, each predicted from the correct previous tokens (teacher forcing).",
            f"Training: {results['steps']} steps in {results['train_seconds']:.0f} s ({results['total_seconds']:.0f} s "
            f"in all, evaluation included); final training loss {results['final_train_loss']:.4f}, validation loss "
            f"{results['validation_loss']:.4f}. Setup: encoder-decoder d_model {args['hidden_size']}, "
            f"{args['num_heads']} heads, d_ff {args['intermediate_size']}, {args['num_layers']}+{args['num_layers']} "
            f"layers, post-LN, ReLU, sinusoidal positions ({results['parameters']:,} parameters); Adam lr "
            f"{args['learning_rate']}, cosine decay, batch {args['batch_size']}, seed {args['seed']}; "
            f"{results['train_strings']:,} fresh training strings, each seen once.",
        ],
        # The page's table is computed from these results when it is rendered (benchmarks/results/quality.py's string_reversal_tables).
        "tables_from": "string_reversal",
        "raw": {"textbook": TEXTBOOK, **results},
    }
    write(page, json_path, json_path.with_suffix(".md"))


def write_results(results: dict, output_dir: Path) -> None:
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    args = results["args"]
    in_range = f"{args['min_length']}-{args['max_length']}"
    lines = [
        "# String reversal",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Greedy `generate`, exact match on {results['eval_size']} fresh strings of length {in_range}: "
        f"**{results['exact_match']:.4f}** (target >= 0.99).",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in length_rows(results)),
        "",
        f"{results['eval_size']} fresh strings per length. Token accuracy counts the reversed letters and the closing "
        "`</s>`, each predicted from the correct previous tokens (teacher forcing).",
        "",
        f"Training: {results['steps']} steps in {results['train_seconds']:.0f} s ({results['total_seconds']:.0f} s in all, "
        f"evaluation included); final training loss {results['final_train_loss']:.4f}, validation loss "
        f"{results['validation_loss']:.4f}.",
        "",
        f"Setup: random lowercase strings of length {in_range} (each training batch fresh: {results['train_strings']:,} "
        f"strings, each seen once); character vocabulary of {len(VOCAB)} tokens (`<pad>`, `<s>`, `</s>`, a-z); "
        f"encoder-decoder d_model {args['hidden_size']}, {args['num_heads']} heads, d_ff {args['intermediate_size']}, "
        f"{args['num_layers']}+{args['num_layers']} layers, post-LN, ReLU, sinusoidal positions "
        f"({results['parameters']:,} parameters); Adam lr {args['learning_rate']}, cosine decay "
        f"({args['warmup_steps']} warmup steps), batch {args['batch_size']}, seed {args['seed']}.",
        "",
        f"Measured on: {results['device']}.",
        "",
        "![loss curve](loss_curve.png)",
        "",
        "![cross-attention](cross_attention.png)",
    ]
    (output_dir / "results.md").write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    """Train, save, reload, evaluate and plot; return the results written to `results.json`."""
    args = parse_args(argv)
    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)

    # Separate generators, so a different --steps leaves the validation and test strings unchanged.
    train_texts = random_strings(
        args.steps * args.batch_size, args.min_length, args.max_length, torch.Generator().manual_seed(args.seed)
    )
    eval_texts = random_strings(
        args.eval_size, args.min_length, args.max_length, torch.Generator().manual_seed(args.seed + 1)
    )
    train_set = TensorDataset(**encode(train_texts))
    eval_set = TensorDataset(**encode(eval_texts))

    set_seed(args.seed)
    model = build_model(args)
    training_args = TrainingArguments(
        output_dir=str(args.output_dir),  # nothing is written there: save_strategy="no"
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=500,
        optim="adamw_torch",
        weight_decay=0.0,  # AdamW without weight decay is Adam
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        logging_steps=max(1, args.steps // 100),  # about 100 points on the loss curve
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set)
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start
    log_history = list(trainer.state.log_history)
    validation_loss = trainer.evaluate()["eval_loss"]
    model_dir = args.output_dir / "model"
    model.save_pretrained(model_dir)

    # Evaluate the saved model as anyone would load it; "eager" attention returns the probabilities to plot.
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    test_generator = torch.Generator().manual_seed(args.seed + 2)
    test_texts = random_strings(args.eval_size, args.min_length, args.max_length, test_generator)
    per_length = []
    for length in EVAL_LENGTHS:
        texts = random_strings(args.eval_size, length, length, test_generator)
        per_length.append(
            {"length": length, "token_accuracy": token_accuracy(model, texts), "exact_match": exact_match(model, texts)}
        )
    results = {
        "task": "string_reversal",
        "command": " ".join(["python examples/train_string_reversal.py", *(sys.argv[1:] if argv is None else argv)]),
        "exact_match": exact_match(model, test_texts),
        "per_length": per_length,
        "validation_loss": validation_loss,
        "final_train_loss": [entry["loss"] for entry in log_history if "loss" in entry][-1],
        "chance_loss": math.log(len(VOCAB)),
        "steps": trainer.state.global_step,
        "train_strings": len(train_texts),
        "eval_size": args.eval_size,
        "parameters": model.num_parameters(),
        "train_seconds": train_seconds,
        "device": describe_device(training_args.device),
        "vocab": list(VOCAB),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(args).items()},
    }
    try:
        save_loss_curve(
            log_history, args.output_dir / "loss_curve.png", "String reversal: 2+2-layer post-LN encoder-decoder",
            chance=math.log(len(VOCAB)), chance_label=f"uniform guess (ln {len(VOCAB)})", log_scale=True,
        )  # fmt: skip
        save_cross_attention(model, args.attention_text, args.output_dir / "cross_attention.png")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[train]'): skipping the figures")
    results["total_seconds"] = time.perf_counter() - start
    write_results(results, args.output_dir)
    if args.json:
        publish(results, args.json)

    print("\n" + "=" * 72)
    print(
        f"string reversal: greedy exact match {results['exact_match']:.4f} on {args.eval_size} fresh strings of "
        f"length {args.min_length}-{args.max_length} (target >= 0.99)"
    )
    print("  length  token accuracy (teacher-forced)  exact match (greedy)")
    for row in per_length:
        print(f"  {row['length']:>6}  {100 * row['token_accuracy']:>30.2f}%  {100 * row['exact_match']:>19.2f}%")
    print(
        f"  final training loss {results['final_train_loss']:.4f}, validation loss {validation_loss:.4f} "
        f"(uniform guess {results['chance_loss']:.3f})"
    )
    print(f"  {results['steps']} steps in {train_seconds:.0f} s ({results['total_seconds']:.0f} s in all)")
    print(f"  model, loss_curve.png, cross_attention.png, results.json, results.md in {args.output_dir}")
    return results


if __name__ == "__main__":
    main()
