"""Fine-tune a saved vaswani model with transformers' `Trainer`: causal LM, sequence classification or seq2seq, from
local JSON lines / JSON / CSV / text files.

The task follows the saved architecture (`...ForCausalLM`, `...ForSequenceClassification`,
`...ForConditionalGeneration`); `--task` overrides it, e.g. to put a classification head on a pretrained decoder.
Every `TrainingArguments` flag passes through (`--learning_rate`, `--num_train_epochs`,
`--per_device_train_batch_size`, `--label_smoothing_factor`, `--eval_strategy`, `--save_steps`,
`--resume_from_checkpoint`, `--seed`, ...), and `--lr_scheduler_type paper` picks the paper's schedule (see
`vaswani.training.VaswaniTrainingArguments`).

    # causal LM on a text file (paragraphs are documents), with the paper's recipe
    python scripts/finetune.py --model my-decoder --train_file train.txt --validation_file valid.txt \\
        --output_dir out --lr_scheduler_type paper --warmup_steps 4000 --label_smoothing_factor 0.1
    # sequence classification from JSON lines {"text": ..., "label": ...}
    python scripts/finetune.py --model my-encoder --task sequence-classification --train_file train.jsonl \\
        --validation_file valid.jsonl --output_dir out --eval_strategy epoch --num_train_epochs 3
    # seq2seq from CSV with columns text,target; two processes (DDP) on one machine
    torchrun --nproc_per_node 2 scripts/finetune.py --model my-seq2seq --train_file train.csv --output_dir out

Writes to `--output_dir`: checkpoints (`checkpoint-<step>/`, as `--save_strategy` says), the final model and tokenizer
(`model/`, safetensors), and `train_results.json`, `eval_results.json`, `all_results.json`. `--resume_from_checkpoint
DIR` (or `last`: the newest checkpoint in `--output_dir`) continues an interrupted run. The same command runs unchanged
under `torchrun` and `accelerate launch` (DDP, or FSDP on GPUs; configs in docs/accelerate).
"""

import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import datasets
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    TrainerCallback,
    default_data_collator,
    set_seed,
)

import vaswani  # noqa: F401  (registers the vaswani configs and models with the Auto classes)
from vaswani.folders import replace_folder
from vaswani.training import VaswaniTrainer, VaswaniTrainingArguments

logger = logging.getLogger("finetune")

TASK_MODELS = {
    "causal-lm": AutoModelForCausalLM,
    "sequence-classification": AutoModelForSequenceClassification,
    "seq2seq": AutoModelForSeq2SeqLM,
}
# How a saved architecture names its task (VaswaniForCausalLM, BertForSequenceClassification, ...).
ARCHITECTURE_TASKS = {
    "ForCausalLM": "causal-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForConditionalGeneration": "seq2seq",
}
# datasets' builder for each data file type; text files are read one paragraph (blank-line separated) per example.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}


@dataclass
class FinetuneArguments:
    model: str = field(metadata={"help": "folder of a saved model (save_pretrained), e.g. a vaswani model"})
    task: str | None = field(
        default=None,
        metadata={"help": "causal-lm, sequence-classification or seq2seq (default: from the saved architecture)"},
    )
    train_file: str | None = field(default=None, metadata={"help": ".jsonl, .json, .csv or .txt training data"})
    validation_file: str | None = field(default=None, metadata={"help": "evaluation data, same formats"})
    text_column: str = field(default="text", metadata={"help": "input text (the source, for seq2seq)"})
    label_column: str = field(default="label", metadata={"help": "class (an int or a name): classification"})
    target_column: str = field(default="target", metadata={"help": "target text: seq2seq"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder (default: --model)"})
    max_length: int | None = field(
        default=None,
        metadata={"help": "tokens per training block (causal LM) or per input (default: the model's limit, <= 1024)"},
    )
    max_target_length: int | None = field(default=None, metadata={"help": "seq2seq target tokens (default: same)"})
    cache_dir: str | None = field(default=None, metadata={"help": "datasets' cache (default: ~/.cache/huggingface)"})

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASK_MODELS:
            raise ValueError(f"--task {self.task!r} is not a task here; choose one of {', '.join(TASK_MODELS)}.")
        if self.train_file is None and self.validation_file is None:
            raise ValueError("Nothing to do: pass --train_file to train, --validation_file to evaluate, or both.")
        for path in (self.train_file, self.validation_file):
            if path is not None and Path(path).suffix.lower() not in FILE_BUILDERS:
                raise ValueError(f"{path}: use a {', '.join(FILE_BUILDERS)} file (the suffix tells the format).")
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{path} does not exist or is not a file.")


def parse_args(argv: list[str] | None = None) -> tuple[FinetuneArguments, VaswaniTrainingArguments]:
    parser = HfArgumentParser((FinetuneArguments, VaswaniTrainingArguments), description=__doc__.split("\n\n")[0])
    return parser.parse_args_into_dataclasses(args=argv)


def infer_task(config: PretrainedConfig, model: str) -> str:
    for architecture in config.architectures or []:
        for suffix, task in ARCHITECTURE_TASKS.items():
            if architecture.endswith(suffix):
                return task
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    raise ValueError(
        f"Cannot tell the task of {model} from its saved architectures {config.architectures}: pass --task "
        f"{' | '.join(TASK_MODELS)}."
    )


# ------------------------------------------------------------------------------------------------------- data


def load_data_file(path: str, cache_dir: str | None) -> datasets.Dataset:
    builder = FILE_BUILDERS[Path(path).suffix.lower()]
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache_dir, **options)


def require_columns(dataset: datasets.Dataset, columns: list[str], path: str, task: str) -> None:
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        flags = {"text": "--text_column", "label": "--label_column", "target": "--target_column"}
        raise ValueError(
            f"{path} has no column {', '.join(map(repr, missing))} (it has {dataset.column_names}); {task} reads "
            f"{columns}: rename them in the file or name yours with {', '.join(flags.values())}."
        )


def default_max_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    return min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", 1024), 1024)


def causal_lm_features(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, text_column: str, block_size: int
) -> datasets.Dataset:
    """Documents joined by end-of-text and cut into blocks of `block_size` tokens (the last partial block of each
    1000 documents is dropped), with labels equal to the inputs: the model shifts them."""

    def tokenize_and_cut(batch: dict[str, list]) -> dict[str, list]:
        stream = []
        for text in batch[text_column]:
            if text and text.strip():
                stream += tokenizer(text.strip())["input_ids"] + [tokenizer.eos_token_id]
        blocks = [stream[start : start + block_size] for start in range(0, len(stream) - block_size + 1, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    return dataset.map(tokenize_and_cut, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


def classification_features(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    label_column: str,
    label2id: dict,
    max_length: int,
) -> datasets.Dataset:
    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)
        encoded["labels"] = [label2id[label] for label in batch[label_column]]
        return encoded

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


def seq2seq_features(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    target_column: str,
    max_length: int,
    max_target_length: int,
) -> datasets.Dataset:
    """Sources as `input_ids`, targets as `labels` ending in end-of-text, so the model learns where to stop."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)
        targets = tokenizer(text_target=batch[target_column], truncation=True, max_length=max_target_length - 1)
        encoded["labels"] = [ids + [tokenizer.eos_token_id] for ids in targets["input_ids"]]
        return encoded

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


def label_mapping(config: PretrainedConfig, labels: list, is_classifier: bool) -> tuple[dict, dict]:
    """The label -> class id mapping for the data, and the config changes it needs (empty: keep the saved head).

    Integer labels are the class ids. Names use the saved classifier's `id2label` when it covers them all, else are
    numbered in sorted order. A model that is not a classifier yet, or whose head has too few classes, gets a new
    head with as many classes as needed.
    """
    if all(isinstance(label, int) and not isinstance(label, bool) for label in labels):
        if min(labels) < 0:
            raise ValueError(f"Class labels must be ids >= 0 or names, found {min(labels)}.")
        label2id = {label: label for label in labels}
        num_labels = max(labels) + 1
        if is_classifier and config.num_labels >= num_labels:
            return label2id, {}
        return label2id, {"num_labels": num_labels}
    if not all(isinstance(label, str) for label in labels):
        raise ValueError(f"Class labels must be all integers or all strings, found {sorted(map(repr, labels))}.")
    saved = {name: int(index) for index, name in (config.id2label or {}).items()}  # the head's class order
    if is_classifier and set(labels) <= set(saved):
        return saved, {}
    names = sorted(labels)
    return {name: index for index, name in enumerate(names)}, {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {name: index for index, name in enumerate(names)},
    }


def prepare_features(
    task: str, args: FinetuneArguments, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[dict[str, datasets.Dataset], dict]:
    """Load and tokenize the data files for `task`: {"train"/"validation": features}, and the config changes the
    model needs (a classification head sized for the data's labels)."""
    files = {split: path for split, path in (("train", args.train_file), ("validation", args.validation_file)) if path}
    raw = {split: load_data_file(path, args.cache_dir) for split, path in files.items()}
    columns = {
        "causal-lm": [args.text_column],
        "sequence-classification": [args.text_column, args.label_column],
        "seq2seq": [args.text_column, args.target_column],
    }[task]
    for split, dataset in raw.items():
        require_columns(dataset, columns, files[split], task)

    max_length = args.max_length or default_max_length(config, tokenizer)
    model_overrides: dict = {}
    if task == "causal-lm":
        encode = partial(causal_lm_features, tokenizer=tokenizer, text_column=args.text_column, block_size=max_length)
    elif task == "sequence-classification":
        labels = sorted({label for dataset in raw.values() for label in dataset.unique(args.label_column)}, key=str)
        is_classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
        label2id, model_overrides = label_mapping(config, labels, is_classifier)
        encode = partial(
            classification_features, tokenizer=tokenizer, text_column=args.text_column,
            label_column=args.label_column, label2id=label2id, max_length=max_length,
        )  # fmt: skip
    else:
        encode = partial(
            seq2seq_features, tokenizer=tokenizer, text_column=args.text_column, target_column=args.target_column,
            max_length=max_length, max_target_length=args.max_target_length or max_length,
        )  # fmt: skip
    features = {split: encode(dataset) for split, dataset in raw.items()}
    for split, dataset in features.items():
        if len(dataset) == 0:
            fix = f"lower --max_length ({max_length}) or add text" if task == "causal-lm" else "add examples"
            raise ValueError(f"{files[split]} gives no {task} examples: {fix}.")
    return features, model_overrides


# ---------------------------------------------------------------------------------------------------- metrics


def token_statistics(logits: torch.Tensor | tuple, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Per sequence: summed negative log-likelihood, correct next-token guesses and scored tokens, (batch, 3).

    Reducing logits to three numbers per sequence before the Trainer gathers them keeps evaluation memory small,
    and the unsmoothed likelihood gives the true perplexity even when training uses label smoothing.
    """
    logits = logits[0] if isinstance(logits, tuple) else logits
    if shift:  # a causal LM's logits at position t predict the token at t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    scored = labels != -100
    targets = labels.clamp(min=0)
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    correct = (logits.argmax(-1) == targets) & scored
    return torch.stack([(nll * scored).sum(1), correct.sum(1).float(), scored.sum(1).float()], dim=1)


def token_metrics(prediction: EvalPrediction) -> dict[str, float]:
    nll, correct, count = prediction.predictions.sum(0)
    return {"perplexity": math.exp(nll / count), "token_accuracy": float(correct / count)}


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}


# ------------------------------------------------------------------------------------------------------- main


def save_final_model(trainer: VaswaniTrainer, output_dir: Path) -> Path:
    """The trained model and tokenizer to `output_dir/model`, written beside it first and then renamed into place."""
    final, staging = output_dir / "model", output_dir / ".model.partial"
    if trainer.is_world_process_zero() and staging.exists():
        shutil.rmtree(staging)  # left by an interrupted run
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # on every process: FSDP gathers the shards; only the main process writes
    if trainer.is_world_process_zero():
        replace_folder(staging, final)
    trainer.accelerator.wait_for_everyone()
    return final


def main(argv: list[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict:
    """Fine-tune and/or evaluate as the command line says; return the metrics and the Trainer's log history.

    Returns:
        `{"task": ..., "train": train metrics, "eval": final eval metrics, "log_history": [...], "model_dir": ...}`
        (`train`/`model_dir` only with `--train_file`, `eval` only with `--validation_file`).
    """
    args, training_args = parse_args(argv)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched, but they did not join one process group (no GPU here?): add "
            f"--use_cpu to train on CPU processes over gloo."
        )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log_level = training_args.get_process_log_level()  # only the main process logs at info level
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    config = AutoConfig.from_pretrained(args.model)
    task = args.task or infer_task(config, args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The main process prepares the data first and caches it; the others then read its cache.
    with training_args.main_process_first(desc="loading and tokenizing the data"):
        features, model_overrides = prepare_features(task, args, config, tokenizer)

    set_seed(training_args.seed)  # a new classification head starts from the same weights on every process
    if model_overrides:
        logger.info("A new classification head with %d classes is initialized.", model_overrides["num_labels"])
    try:
        model = TASK_MODELS[task].from_pretrained(
            args.model, **model_overrides, ignore_mismatched_sizes=bool(model_overrides)
        )
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise ValueError(
            f"{args.model} is a {config.model_type} model, which has no {task} form: pick another --task."
        ) from error

    if task == "sequence-classification":
        collator, compute_metrics, reduce_logits = DataCollatorWithPadding(tokenizer), accuracy, _argmax
    else:
        collator = default_data_collator if task == "causal-lm" else DataCollatorForSeq2Seq(tokenizer, model=model)
        compute_metrics = token_metrics
        reduce_logits = partial(token_statistics, shift=task == "causal-lm")
    trainer = VaswaniTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=features.get("train"),
        eval_dataset=features.get("validation"),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=reduce_logits,
        callbacks=callbacks,
    )
    fsdp_requested = bool(training_args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and not trainer.is_fsdp_enabled:
        # accelerate turns FSDP on only for GPU (and other accelerator) process groups; CPU processes would silently
        # train with plain DDP instead.
        raise ValueError(
            "FSDP was requested, but accelerate runs CPU processes (--use_cpu, or no GPU) as plain DDP: launch on "
            "GPUs, or use docs/accelerate/ddp_cpu.yaml for CPU processes."
        )

    results: dict = {"task": task}
    if "train" in features:
        resume = training_args.resume_from_checkpoint
        if resume is not None and resume.lower() in ("true", "last"):
            resume = True  # --resume_from_checkpoint last: the newest checkpoint in --output_dir
        train_output = trainer.train(resume_from_checkpoint=resume)
        results["model_dir"] = str(save_final_model(trainer, Path(training_args.output_dir)))
        results["train"] = train_output.metrics
        trainer.log_metrics("train", train_output.metrics)
        trainer.save_metrics("train", train_output.metrics)
    if "validation" in features:
        results["eval"] = trainer.evaluate()
        trainer.log_metrics("eval", results["eval"])
        trainer.save_metrics("eval", results["eval"])
    results["log_history"] = list(trainer.state.log_history)
    return results


def _argmax(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)


if __name__ == "__main__":
    main(sys.argv[1:])
