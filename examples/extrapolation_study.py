"""Length extrapolation: how each position encoding copes with sequences longer than any it was trained on.

Models that differ only in `position_embedding_type` (sinusoidal, learned, rope, alibi, relative_bias, none) are
trained with the same size, seeds, steps and data, then evaluated at longer lengths:

- **Decoder** (language model on the shipped story corpus, the demo's tokenizer and split): trained on windows of
  128 tokens, evaluated by held-out perplexity at 1x, 2x, 4x and 8x that length.
  - *full context*: each evaluation window is read in one pass, so positions run up to the evaluation length;
  - *sliding window*: the same tokens, read by windows of the training length with a stride of half of it, so
    every token is predicted from at most the training length of context and no position is ever new;
  - RoPE is also evaluated with transformers' `rope_type` scalings set at inference (`linear` and `yarn` with
    factor = evaluation length / training length, `dynamic` NTK), on the weights trained with plain RoPE.
  - Learned positions have no vector past their table: those cells say so ("n/a (table ends at 128)").
- **Encoder-decoder** (the textbook's string reversal and its model, pre-LN; data from `train_string_reversal.py`):
  trained on strings of 3 to 10 letters, evaluated by teacher-forced token accuracy and greedy exact match up to 20 letters.

    python examples/extrapolation_study.py --output outputs/extrapolation            # full: 3 seeds, ~40 min on 2 cores
    python examples/extrapolation_study.py --quick --output /tmp/extrapolation-quick   # tiny models, seconds (CI)

Writes to `--output`: `results.csv` (one row per seed, model, evaluation and length), `results.md` (mean and
standard deviation over seeds), `decoder_perplexity.png` and `reversal_accuracy.png`. Everything is seeded.
"""

import argparse
import copy
import csv
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

# Threads that wait for work sleep instead of spinning (see demo.py); read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm.auto import tqdm
from transformers import set_seed

# The sibling scripts own the data: the demo's corpus split, tokenizer, batch sampler and schedule, and the string
# reversal task's strings and encoding.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo  # noqa: E402
import train_string_reversal as reversal  # noqa: E402

from vaswani import (  # noqa: E402
    VaswaniDecoderConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniSeq2SeqConfig,
)
from vaswani.evaluation.perplexity import summed_nll  # noqa: E402
from vaswani.modeling.configuration import POSITION_EMBEDDING_TYPES  # noqa: E402
from vaswani.training import describe_device  # noqa: E402

ROPE_SCALINGS = ("linear", "dynamic", "yarn")
CSV_COLUMNS = (
    "task",
    "encoding",
    "rope_scaling",
    "evaluation",
    "seed",
    "train_length",
    "eval_length",
    "metric",
    "value",
    "note",
)


@dataclass
class DecoderSetup:
    """The language-model half of the study."""

    train_length: int = 128
    length_multiples: tuple[int, ...] = (1, 2, 4, 8)
    steps: int = 400
    batch_size: int = 8
    learning_rate: float = 3e-3
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    # Every window of every length covers the same held-out tokens; None uses all the held-out stream allows.
    eval_tokens: int | None = None


@dataclass
class ReversalSetup:
    """The encoder-decoder half: string reversal, trained on min_length..max_length letters."""

    min_length: int = 3
    max_length: int = 10
    eval_lengths: tuple[int, ...] = (3, 5, 7, 10, 12, 15, 20)
    steps: int = 700
    batch_size: int = 64
    learning_rate: float = 3e-3
    hidden_size: int = 96
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 192
    # Pre-LN: with the textbook's post-LN at this budget, 5 of the 15 runs with positions stayed at chance loss.
    norm_position: str = "pre"
    eval_size: int = 500


@dataclass
class Args:
    output: Path
    quick: bool
    seeds: list[int]
    encodings: list[str]
    tasks: list[str]
    threads: int
    decoder: DecoderSetup = field(default_factory=DecoderSetup)
    reversal: ReversalSetup = field(default_factory=ReversalSetup)


QUICK_DECODER = DecoderSetup(
    train_length=16, steps=4, batch_size=4, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, eval_tokens=256
)
QUICK_REVERSAL = ReversalSetup(
    min_length=3, max_length=5, eval_lengths=(3, 5, 8), steps=4, batch_size=16, hidden_size=32, num_layers=1,
    num_heads=2, intermediate_size=64, eval_size=16,
)


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("outputs/extrapolation"), help="where results are written")
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps, one seed: checks the pipeline")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument(
        "--encodings", nargs="+", default=list(POSITION_EMBEDDING_TYPES), choices=POSITION_EMBEDDING_TYPES
    )
    parser.add_argument("--tasks", nargs="+", default=["decoder", "reversal"], choices=["decoder", "reversal"])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--decoder-steps", type=int, default=None, help="override the decoder's training steps")
    parser.add_argument("--reversal-steps", type=int, default=None, help="override string reversal's training steps")
    namespace = parser.parse_args(argv)
    decoder = copy.copy(QUICK_DECODER if namespace.quick else DecoderSetup())
    reversal_setup = copy.copy(QUICK_REVERSAL if namespace.quick else ReversalSetup())
    if namespace.decoder_steps is not None:
        decoder.steps = namespace.decoder_steps
    if namespace.reversal_steps is not None:
        reversal_setup.steps = namespace.reversal_steps
    seeds = namespace.seeds if namespace.seeds is not None else ([0] if namespace.quick else [0, 1, 2])
    if min(decoder.steps, reversal_setup.steps) < 1 or namespace.threads < 1:
        parser.error("--decoder-steps, --reversal-steps and --threads must be at least 1")
    return Args(
        output=namespace.output,
        quick=namespace.quick,
        seeds=seeds,
        encodings=namespace.encodings,
        tasks=namespace.tasks,
        threads=namespace.threads,
        decoder=decoder,
        reversal=reversal_setup,
    )


def result_row(task: str, encoding: str, evaluation: str, seed: int, train_length: int, eval_length: int, metric: str,
               value: float | None, note: str = "", rope_scaling: str = "") -> dict:
    """One CSV row; `value` is None (an empty cell) where the model cannot be evaluated, and `note` says why."""
    return dict(
        task=task, encoding=encoding, rope_scaling=rope_scaling, evaluation=evaluation, seed=seed,
        train_length=train_length, eval_length=eval_length, metric=metric, value=value, note=note,
    )


def table_end_note(config) -> str:
    return f"n/a (table ends at {config.max_position_embeddings})"


# --------------------------------------------------------------------------------------------------- decoder


def decoder_config(encoding: str, setup: DecoderSetup, vocab_size: int, tokenizer) -> VaswaniDecoderConfig:
    # Identical but for the position encoding. Embeddings are scaled by sqrt(d_model) for every encoding, as in the
    # paper: sinusoidal positions need it (unit-amplitude sines would drown 0.02-std embeddings), and giving it to all
    # six keeps the position encoding the only difference. The learned table ends at the training length.
    return VaswaniDecoderConfig(
        vocab_size=vocab_size,
        hidden_size=setup.hidden_size,
        num_hidden_layers=setup.num_layers,
        num_attention_heads=setup.num_heads,
        intermediate_size=4 * setup.hidden_size,
        hidden_act="gelu",
        position_embedding_type=encoding,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=setup.train_length,
        norm_type="layernorm",
        norm_position="pre",
        embedding_scale=True,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def train_steps(model, optimizer, steps: int, learning_rate: float, batch_loss, desc: str) -> float:
    """`steps` optimizer steps on `batch_loss()` with the demo's warmup + cosine schedule and gradient clipping at 1;
    returns the mean loss of the last tenth of the steps."""
    losses = []
    model.train()
    for step in tqdm(range(steps), desc=desc, leave=False, mininterval=5):
        for group in optimizer.param_groups:
            group["lr"] = demo.learning_rate(step / steps, learning_rate)
        loss = batch_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def train_decoder(model: VaswaniForCausalLM, data: torch.Tensor, setup: DecoderSetup, seed: int, desc: str) -> float:
    """AdamW on random windows of `train_length` tokens (`train_steps`)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)

    def batch_loss() -> torch.Tensor:
        batch = demo.random_batch(data, setup.train_length, setup.batch_size, generator)
        return model(batch, labels=batch).loss

    return train_steps(model, optimizer, setup.steps, setup.learning_rate, batch_loss, desc)


def full_context_perplexity(model: VaswaniForCausalLM, tokens: torch.Tensor, length: int) -> float:
    """Perplexity over `tokens` cut into consecutive windows of `length`, each read in one pass
    (`vaswani perplexity` with context = stride = `length`)."""
    total, count = summed_nll(model, tokens, "text-generation", length, length, batch_tokens=8192)
    return math.exp(total / count)


def sliding_window_perplexity(model: VaswaniForCausalLM, tokens: torch.Tensor, length: int, window: int) -> float:
    """Perplexity over the same windows of `length`, each read by sub-windows of `window` tokens with a stride of
    `window // 2` (`vaswani perplexity`'s strided windows, run on each sequence of `length`): every sub-window after
    the first scores only its new tokens, which it predicts from between `window // 2` and `window` tokens of
    context. No position past `window - 1` is ever used."""
    total, count = 0.0, 0
    for sequence in tokens.view(-1, length):
        sequence_total, sequence_count = summed_nll(
            model, sequence, "text-generation", window, window // 2, batch_tokens=8192
        )
        total, count = total + sequence_total, count + sequence_count
    return math.exp(total / count)


def with_rope_scaling(model: VaswaniForCausalLM, scaling: str, factor: float) -> VaswaniForCausalLM:
    """The trained weights under a RoPE scaling chosen at inference: a copy of the config with transformers'
    `rope_parameters` for `scaling` (the reference length is the training length, `max_position_embeddings`)."""
    config = copy.deepcopy(model.config)
    parameters = {"rope_type": scaling, "rope_theta": 10000.0, "factor": float(factor)}
    if scaling == "dynamic":
        # Dynamic NTK picks its own base from the sequence length; factor 1 gives exactly the base that length needs.
        parameters["factor"] = 1.0
    if scaling == "yarn":
        parameters["original_max_position_embeddings"] = config.max_position_embeddings
    config.rope_parameters = parameters
    config.validate()
    scaled = VaswaniForCausalLM(config)
    scaled.load_state_dict(model.state_dict())
    return scaled.eval()


def check_rope_scaling_applies(base: VaswaniForCausalLM, scaled: VaswaniForCausalLM, length: int, scaling: str) -> None:
    """Fail loudly if a scaling leaves the rotary angles unchanged at a length past training (a silent no-op would
    report plain RoPE under another name)."""
    positions = torch.arange(length)[None]
    probe = torch.zeros(1, length, base.config.hidden_size)
    base_cos, _ = base.model.positions.rotary(probe, positions)
    scaled_cos, _ = scaled.model.positions.rotary(probe, positions)
    if torch.equal(base_cos, scaled_cos):
        raise RuntimeError(f"rope_type={scaling!r} did not change the rotary angles at length {length}")


def evaluate_decoder(model: VaswaniForCausalLM, encoding: str, seed: int, tokens: torch.Tensor, setup: DecoderSetup) -> list[dict]:
    rows = []
    train_length = setup.train_length

    def add(evaluation: str, length: int, compute: Callable[[], float], rope_scaling: str = "") -> None:
        try:
            value, note = compute(), ""
        except ValueError as error:  # learned positions past their table: the model's own error, reported
            if "max_position_embeddings" not in str(error):
                raise
            value, note = None, table_end_note(model.config)
        rows.append(result_row("decoder", encoding, evaluation, seed, train_length, length, "perplexity", value, note,
                               rope_scaling))

    for multiple in setup.length_multiples:
        length = multiple * train_length
        add("full", length, partial(full_context_perplexity, model, tokens, length))
        add("sliding", length, partial(sliding_window_perplexity, model, tokens, length, train_length))
        if encoding == "rope":
            for scaling in ROPE_SCALINGS:
                scaled = with_rope_scaling(model, scaling, multiple)
                if multiple > 1:
                    check_rope_scaling_applies(model, scaled, length, scaling)
                add("full", length, partial(full_context_perplexity, scaled, tokens, length), scaling)
    return rows


def run_decoder(args: Args, progress: tqdm, emit: Callable[[list[dict]], None]) -> dict:
    setup = args.decoder
    tokenizer, train_data, heldout = demo.load_data(setup.vocab_size)
    longest = max(setup.length_multiples) * setup.train_length
    usable = len(heldout) if setup.eval_tokens is None else min(len(heldout), setup.eval_tokens)
    tokens = heldout[: usable // longest * longest]
    if not len(tokens):
        raise ValueError(f"The held-out stream ({len(heldout)} tokens) is shorter than one window of {longest} tokens.")
    info = {"train_tokens": len(train_data), "eval_tokens": len(tokens), "seconds": {}}
    for encoding in args.encodings:
        for seed in args.seeds:
            start = time.perf_counter()
            set_seed(seed)
            model = VaswaniForCausalLM(decoder_config(encoding, setup, len(tokenizer), tokenizer))
            info["parameters"] = model.num_parameters()
            train_loss = train_decoder(model, train_data, setup, seed, desc=f"decoder {encoding} seed {seed}")
            train_row = result_row("decoder", encoding, "train", seed, setup.train_length, setup.train_length,
                                   "train_loss", train_loss)
            emit([train_row, *evaluate_decoder(model, encoding, seed, tokens, setup)])
            info["seconds"][(encoding, seed)] = time.perf_counter() - start
            progress.update()
            progress.set_postfix_str(f"decoder {encoding} seed {seed}: {info['seconds'][(encoding, seed)]:.0f} s")
    return info


# -------------------------------------------------------------------------------------------------- reversal


def reversal_config(encoding: str, setup: ReversalSetup) -> VaswaniSeq2SeqConfig:
    # The textbook's 2017-style shape (train_string_reversal.build_model) with pre-LN (ReversalSetup) and the
    # position encoding switched. The learned table holds the longest training sequence: max_length letters and </s>.
    return VaswaniSeq2SeqConfig.from_preset(
        "transformer-base",
        vocab_size=len(reversal.VOCAB),
        hidden_size=setup.hidden_size,
        num_attention_heads=setup.num_heads,
        intermediate_size=setup.intermediate_size,
        encoder_layers=setup.num_layers,
        decoder_layers=setup.num_layers,
        hidden_dropout=0.0,
        norm_position=setup.norm_position,
        position_embedding_type=encoding,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=setup.max_length + 1,
        pad_token_id=reversal.PAD,
        bos_token_id=reversal.BOS,
        eos_token_id=reversal.EOS,
        decoder_start_token_id=reversal.BOS,
    )


def train_reversal(model: VaswaniForConditionalGeneration, setup: ReversalSetup, seed: int, desc: str) -> float:
    """Adam on fresh random strings every step (`train_steps`)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.learning_rate, weight_decay=0.0)

    def batch_loss() -> torch.Tensor:
        texts = reversal.random_strings(setup.batch_size, setup.min_length, setup.max_length, generator)
        return model(**reversal.encode(texts)).loss

    return train_steps(model, optimizer, setup.steps, setup.learning_rate, batch_loss, desc)


def evaluate_reversal(model: VaswaniForConditionalGeneration, encoding: str, seed: int, setup: ReversalSetup) -> list[dict]:
    rows = []
    # The test strings depend on the seed only through a fixed offset, so every encoding sees the same ones.
    generator = torch.Generator().manual_seed(10_000 + seed)
    for length in setup.eval_lengths:
        texts = reversal.random_strings(setup.eval_size, length, length, generator)
        for metric, compute in (("token_accuracy", reversal.token_accuracy), ("exact_match", reversal.exact_match)):
            try:
                value, note = compute(model, texts), ""
            except ValueError as error:
                if "max_position_embeddings" not in str(error):
                    raise
                value, note = None, table_end_note(model.config)
            rows.append(result_row("reversal", encoding, "greedy" if metric == "exact_match" else "teacher_forced",
                                   seed, setup.max_length, length, metric, value, note))
    return rows


def run_reversal(args: Args, progress: tqdm, emit: Callable[[list[dict]], None]) -> dict:
    setup = args.reversal
    info = {"seconds": {}}
    for encoding in args.encodings:
        for seed in args.seeds:
            start = time.perf_counter()
            set_seed(seed)
            model = VaswaniForConditionalGeneration(reversal_config(encoding, setup))
            info["parameters"] = model.num_parameters()
            train_loss = train_reversal(model, setup, seed, desc=f"reversal {encoding} seed {seed}")
            train_row = result_row("reversal", encoding, "train", seed, setup.max_length, setup.max_length,
                                   "train_loss", train_loss)
            emit([train_row, *evaluate_reversal(model, encoding, seed, setup)])
            info["seconds"][(encoding, seed)] = time.perf_counter() - start
            progress.update()
            progress.set_postfix_str(f"reversal {encoding} seed {seed}: {info['seconds'][(encoding, seed)]:.0f} s")
    return info


# --------------------------------------------------------------------------------------------------- results


def model_name(row: dict) -> str:
    return f"{row['encoding']} + {row['rope_scaling']}" if row["rope_scaling"] else row["encoding"]


def aggregate(rows: list[dict], task: str, evaluation: str, metric: str) -> dict[str, dict[int, dict]]:
    """{model: {eval_length: {"values": [...], "note": str}}} for one task, evaluation and metric, in row order."""
    table: dict[str, dict[int, dict]] = {}
    for row in rows:
        if (row["task"], row["evaluation"], row["metric"]) != (task, evaluation, metric):
            continue
        cell = table.setdefault(model_name(row), {}).setdefault(row["eval_length"], {"values": [], "note": ""})
        if row["value"] is None:
            cell["note"] = row["note"]
        else:
            cell["values"].append(row["value"])
    return table


def mean_and_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def format_cell(cell: dict, percent: bool = False) -> str:
    if not cell["values"]:
        return cell["note"] or "n/a"
    mean, std = mean_and_std(cell["values"])
    if percent:
        return f"{100 * mean:.1f} ± {100 * std:.1f}"
    digits = 2 if mean < 100 else 0
    return f"{mean:,.{digits}f} ± {std:,.{digits}f}"


def markdown_table(table: dict[str, dict[int, dict]], lengths: list[int], header: str, percent: bool = False,
                   ratio: bool = False) -> list[str]:
    columns = [str(length) for length in lengths] + (["longest / shortest"] if ratio else [])
    lines = [f"| {header} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, cells in table.items():
        line = [format_cell(cells.get(length, {"values": [], "note": ""}), percent) for length in lengths]
        if ratio:
            first, last = cells.get(lengths[0]), cells.get(lengths[-1])
            line.append(
                f"{statistics.fmean(last['values']) / statistics.fmean(first['values']):.2f}x"
                if first and last and first["values"] and last["values"]
                else "n/a"
            )
        lines.append(f"| {name} | " + " | ".join(line) + " |")
    return lines


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "value": "" if row["value"] is None else f"{row['value']:.6g}"})


def write_markdown(rows: list[dict], args: Args, infos: dict, command: str, seconds: float, path: Path) -> None:
    seeds = ", ".join(map(str, args.seeds))
    spread = "mean ± standard deviation over seeds " + seeds if len(args.seeds) > 1 else f"seed {seeds}"
    lines = ["# Length extrapolation by position encoding", "", f"Command: `{command}`", "",
             f"Every cell: {spread}. Total time {seconds / 60:.1f} min; "
             f"{describe_device()}.", ""]
    if "decoder" in infos:
        setup, info = args.decoder, infos["decoder"]
        lengths = [multiple * setup.train_length for multiple in setup.length_multiples]
        lines += [
            "## Decoder: held-out perplexity on the story corpus",
            "",
            f"Trained on windows of {setup.train_length} tokens ({setup.steps} steps of {setup.batch_size} windows, "
            f"{info['train_tokens']:,}-token training stream, BPE vocabulary {setup.vocab_size}); d_model "
            f"{setup.hidden_size}, {setup.num_layers} pre-LN layers, {setup.num_heads} heads, GELU, embeddings scaled "
            f"by sqrt(d_model), {info['parameters']:,} parameters. Every length scores the same "
            f"{info['eval_tokens']:,} held-out tokens; columns are evaluation lengths in tokens.",
            "",
            "### Full context (positions up to the evaluation length)",
            "",
            *markdown_table(aggregate(rows, "decoder", "full", "perplexity"), lengths, "encoding", ratio=True),
            "",
            f"### Sliding window ({setup.train_length}-token windows, stride {setup.train_length // 2})",
            "",
            *markdown_table(aggregate(rows, "decoder", "sliding", "perplexity"), lengths, "encoding", ratio=True),
            "",
            "Final training loss (mean of the last tenth of the steps): "
            + ", ".join(
                f"{name} {format_cell(cells[setup.train_length])}"
                for name, cells in aggregate(rows, "decoder", "train", "train_loss").items()
            )
            + ".",
            "",
            "![decoder perplexity](decoder_perplexity.png)",
            "",
        ]
    if "reversal" in infos:
        setup, info = args.reversal, infos["reversal"]
        lengths = list(setup.eval_lengths)
        lines += [
            "## Encoder-decoder: string reversal",
            "",
            f"Trained on random strings of {setup.min_length}-{setup.max_length} letters ({setup.steps} steps of "
            f"{setup.batch_size} fresh strings); the textbook's shape with {setup.norm_position}-LN, d_model {setup.hidden_size}, "
            f"{setup.num_layers}+{setup.num_layers} layers, {setup.num_heads} heads, d_ff {setup.intermediate_size}, "
            f"{info['parameters']:,} parameters. {setup.eval_size} fresh strings per length; columns are string "
            "lengths (the sequences are one longer, with </s>). Values in %.",
            "",
            "### Teacher-forced token accuracy",
            "",
            *markdown_table(aggregate(rows, "reversal", "teacher_forced", "token_accuracy"), lengths, "encoding",
                            percent=True),
            "",
            "### Greedy exact match",
            "",
            *markdown_table(aggregate(rows, "reversal", "greedy", "exact_match"), lengths, "encoding", percent=True),
            "",
            "![string reversal accuracy](reversal_accuracy.png)",
            "",
        ]
    lines += ["## Time per model (training and evaluation, mean over seeds)", ""]
    for task, info in infos.items():
        per_encoding: dict[str, list[float]] = {}
        for (encoding, _), value in info["seconds"].items():
            per_encoding.setdefault(encoding, []).append(value)
        lines.append(f"- {task}: " + ", ".join(f"{k} {statistics.fmean(v):.0f} s" for k, v in per_encoding.items()))
    path.write_text("\n".join(lines) + "\n")


# One color per model in every figure and panel.
MODEL_COLORS = {name: f"C{index}" for index, name in enumerate(
    [*POSITION_EMBEDDING_TYPES, *(f"rope + {scaling}" for scaling in ROPE_SCALINGS)]
)}


def plot_lines(ax, table: dict[str, dict[int, dict]], lengths: list[int], scale: float = 1.0) -> None:
    """One line per model: mean over seeds, error bars of one standard deviation; missing cells are gaps."""
    for name, cells in table.items():
        means, stds = [], []
        for length in lengths:
            values = cells.get(length, {"values": []})["values"]
            mean, std = mean_and_std(values) if values else (math.nan, math.nan)
            means.append(mean * scale)
            stds.append(std * scale)
        scaled = "+" in name
        ax.errorbar(lengths, means, yerr=stds, marker="o", markersize=4, capsize=3, label=name,
                    linestyle="--" if scaled else "-", color=MODEL_COLORS[name], linewidth=1.2 if scaled else 1.8)


def save_figures(rows: list[dict], args: Args, infos: dict, output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    written = []
    if "decoder" in infos:
        setup = args.decoder
        lengths = [multiple * setup.train_length for multiple in setup.length_multiples]
        fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
        for ax, evaluation, title in (
            (axes[0], "full", "full context: positions up to the evaluation length"),
            (axes[1], "sliding", f"sliding window of {setup.train_length} tokens"),
        ):
            plot_lines(ax, aggregate(rows, "decoder", evaluation, "perplexity"), lengths)
            ax.axvline(setup.train_length, color="gray", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_xticks(lengths, [str(length) for length in lengths])
            ax.set_xlabel("evaluation length (tokens)")
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3, which="both")
        axes[0].set_ylabel("held-out perplexity (log scale)")
        axes[0].legend(fontsize=8)
        learned_note = f"learned: no positions past {setup.train_length} (only the first point)"
        fig.suptitle(f"Decoder trained on {setup.train_length}-token windows; {learned_note}", fontsize=11)
        fig.tight_layout()
        written.append(output / "decoder_perplexity.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    if "reversal" in infos:
        setup = args.reversal
        lengths = list(setup.eval_lengths)
        fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
        for ax, evaluation, metric, title in (
            (axes[0], "teacher_forced", "token_accuracy", "teacher-forced token accuracy"),
            (axes[1], "greedy", "exact_match", "greedy exact match"),
        ):
            plot_lines(ax, aggregate(rows, "reversal", evaluation, metric), lengths, scale=100.0)
            ax.axvspan(setup.min_length, setup.max_length, color="gray", alpha=0.12, label="training lengths")
            ax.set_xlabel("string length (letters)")
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("accuracy (%)")
        axes[0].legend(fontsize=8)
        fig.suptitle(
            f"String reversal trained on {setup.min_length}-{setup.max_length} letters; learned: no positions past "
            f"{setup.max_length + 1}",
            fontsize=11,
        )
        fig.tight_layout()
        written.append(output / "reversal_accuracy.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


# ------------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> list[dict]:
    """Train and evaluate every model; write results.csv, results.md and the figures; return the CSV rows."""
    args = parse_args(argv)
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    args.output.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python examples/extrapolation_study.py", *(sys.argv[1:] if argv is None else argv)])
    rows, infos = [], {}
    runners: dict[str, Callable[[Args, tqdm, Callable[[list[dict]], None]], dict]] = {
        "decoder": run_decoder,
        "reversal": run_reversal,
    }
    with tqdm(total=len(args.tasks) * len(args.encodings) * len(args.seeds), desc="models") as progress:

        def emit(model_rows: list[dict]) -> None:
            # Written after each model, so a long run that is stopped leaves what it measured behind.
            rows.extend(model_rows)
            write_csv(rows, args.output / "results.csv")

        for task in args.tasks:
            infos[task] = runners[task](args, progress, emit)
    figures = save_figures(rows, args, infos, args.output)
    write_markdown(rows, args, infos, command, time.perf_counter() - start, args.output / "results.md")
    print(f"wrote results.csv, results.md, {', '.join(path.name for path in figures)} to {args.output} "
          f"in {(time.perf_counter() - start) / 60:.1f} min")
    return rows


if __name__ == "__main__":
    main()
