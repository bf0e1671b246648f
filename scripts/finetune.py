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
    # chat: LoRA on conversations ({"messages": [{"role": ..., "content": ...}, ...]} per line), merged afterwards
    python scripts/finetune.py --model my-chat-model --train_file chats.jsonl --output_dir out --lora --merge

A JSON lines file with a `messages` column is chat data: each conversation is rendered with the tokenizer's chat
template, and only the assistant's tokens are trained (the other labels are -100). `--packing` batches them without
padding (transformers' `DataCollatorWithFlattening`). Plain text is cut into blocks of `--max_length` tokens; by default
the block follows the data (the whole file, when it is shorter than the model's limit) and the last partial block is
kept (`--drop_last_block` drops it).

`--lora` trains low-rank adapters (PEFT) on the attention and feed-forward projections and leaves the base weights
frozen; `model/` then holds the adapter alone (load it with `PeftModel.from_pretrained`), or with `--merge` the plain
merged model (and `adapter/` the adapter). `--qlora 4bit|8bit` loads the frozen base in 4 or 8 bits (bitsandbytes,
CUDA only).

Writes to `--output_dir`: checkpoints (`checkpoint-<step>/`, as `--save_strategy` says), the final model and tokenizer
(`model/`, safetensors, with `loss_curve.png`), and `train_results.json`, `eval_results.json`, `all_results.json`.
Training shows the loss, perplexity and tokens/s of every log. `--resume_from_checkpoint DIR` (or `last`: the newest
checkpoint in `--output_dir`) continues an interrupted run. The same command runs unchanged under `torchrun` and
`accelerate launch` (DDP, or FSDP on GPUs; configs in docs/accelerate).
"""

import copy
import importlib.util
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
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    TrainerCallback,
    set_seed,
)

import vaswani  # noqa: F401  (registers the vaswani configs and models with the Auto classes)
from vaswani.chat import IGNORE_INDEX, chat_example
from vaswani.folders import replace_folder
from vaswani.training import TrainingProgress, VaswaniTrainer, VaswaniTrainingArguments, save_loss_curve

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
# LoRA's default targets: every projection of attention and the feed-forward that the model has (vaswani, LLaMA and
# most decoders name them so; gate_proj exists only with a gated feed-forward).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}
# The longest default block or input: longer ones cost memory quadratically in attention, and few fine-tuning sets
# need them (--max_length sets any length the model allows).
DEFAULT_LENGTH_CAP = 1024


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
    messages_column: str = field(
        default="messages", metadata={"help": "conversations (lists of role/content messages): chat data, causal LM"}
    )
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer folder (default: --model)"})
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "tokens per training block (text), per conversation (chat) or per input (default: follows the "
            "data: the longest conversation or the whole text, within the model's limit and 1024)"
        },
    )
    max_target_length: int | None = field(default=None, metadata={"help": "seq2seq target tokens (default: same)"})
    drop_last_block: bool = field(
        default=False, metadata={"help": "text: drop the last block when it is shorter than --max_length (kept)"}
    )
    packing: bool = field(
        default=False,
        metadata={"help": "causal LM: batch examples without padding, as one row whose positions restart per example"},
    )
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (PEFT) instead of every weight"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scale numerator: updates are alpha/r * B A x"})
    lora_dropout: float = field(default=0.05, metadata={"help": "dropout on LoRA's input"})
    lora_target_modules: str | None = field(
        default=None,
        metadata={"help": f"comma-separated linear layer names (default: those of {','.join(LORA_TARGET_MODULES)} "
                  "the model has)"},
    )  # fmt: skip
    merge: bool = field(
        default=False, metadata={"help": "with --lora: save the merged plain model in model/, the adapter in adapter/"}
    )
    qlora: str | None = field(
        default=None,
        metadata={"help": "4bit or 8bit: load the frozen base quantized (bitsandbytes, CUDA); implies --lora"},
    )
    cache_dir: str | None = field(default=None, metadata={"help": "datasets' cache (default: ~/.cache/huggingface)"})

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASK_MODELS:
            raise ValueError(f"--task {self.task!r} is not a task here; choose one of {', '.join(TASK_MODELS)}.")
        if self.qlora is not None:
            if self.qlora not in ("4bit", "8bit"):
                raise ValueError(f"--qlora {self.qlora!r}: use --qlora 4bit or --qlora 8bit.")
            self.lora = True
        if self.merge and not self.lora:
            raise ValueError("--merge merges LoRA adapters into the model: add --lora (a full fine-tune needs none).")
        if self.merge and self.qlora:
            raise ValueError(
                "--merge with --qlora would merge into rounded 4/8-bit weights: train with --qlora, then merge the "
                "saved adapter into the full-precision base (PeftModel.from_pretrained(base, adapter).merge_and_unload())."
            )
        if self.lora and (self.lora_r < 1 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1):
            raise ValueError(
                f"LoRA needs --lora_r >= 1, --lora_alpha > 0 and 0 <= --lora_dropout < 1; got {self.lora_r}, "
                f"{self.lora_alpha}, {self.lora_dropout}."
            )
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"--max_length {self.max_length} is too short to train on: use 2 or more tokens.")
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
    """The longest input the model and tokenizer allow, within `DEFAULT_LENGTH_CAP`."""
    return min(
        tokenizer.model_max_length, getattr(config, "max_position_embeddings", DEFAULT_LENGTH_CAP), DEFAULT_LENGTH_CAP
    )


def tokenize_documents(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, text_column: str
) -> datasets.Dataset:
    """Each non-empty document's tokens followed by end-of-text, so the model learns where documents end."""

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [text.strip() for text in batch[text_column] if text and text.strip()]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return {"input_ids": [document + [tokenizer.eos_token_id] for document in ids]}

    return dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


def causal_lm_blocks(documents: datasets.Dataset, block_size: int, drop_last_block: bool) -> datasets.Dataset:
    """The documents' tokens joined into one stream and cut into blocks of `block_size` tokens, with labels equal to
    the inputs (the model shifts them). The last block is shorter unless the stream divides evenly; it is kept
    (padded in its batch, its padding not scored) unless `drop_last_block`."""

    def cut(batch: dict[str, list]) -> dict[str, list]:
        stream = [token for document in batch["input_ids"] for token in document]
        stop = len(stream) - block_size + 1 if drop_last_block else len(stream)
        blocks = [stream[start : start + block_size] for start in range(0, max(stop, 0), block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    # One batch: the stream has a single end, so only its last block can be partial.
    return documents.map(cut, batched=True, batch_size=None, remove_columns=documents.column_names, desc="blocks")


def tokenize_conversations(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, messages_column: str
) -> datasets.Dataset:
    """Conversations rendered with the chat template, labelled on the assistant's tokens only (`vaswani.chat`)."""

    def encode(batch: dict[str, list]) -> dict[str, list]:
        examples = [chat_example(tokenizer, messages) for messages in batch[messages_column]]
        return {key: [example[key] for example in examples] for key in ("input_ids", "attention_mask", "labels")}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="rendering conversations")


def truncate_conversations(conversations: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """Conversations cut to `max_length` tokens; those left with no assistant token to score are dropped."""

    def cut(batch: dict[str, list]) -> dict[str, list]:
        cut_batch = {key: [row[:max_length] for row in rows] for key, rows in batch.items()}
        # A causal LM scores a label from the second position on (the first token has nothing before it).
        keep = [any(label != IGNORE_INDEX for label in labels[1:]) for labels in cut_batch["labels"]]
        return {key: [row for row, kept in zip(rows, keep) if kept] for key, rows in cut_batch.items()}

    return conversations.map(cut, batched=True, desc="truncating")


def causal_lm_features(
    raw: dict[str, datasets.Dataset],
    tokenizer: PreTrainedTokenizerBase,
    args: "FinetuneArguments",
    limit: int,
    chat: bool,
) -> tuple[dict[str, datasets.Dataset], int]:
    """Causal-LM features for every split, and the length they were cut to: `--max_length`, or by default the
    longest conversation (chat) or the training text's whole length, within `limit` (the model's)."""
    if chat:
        tokenized = {
            split: tokenize_conversations(data, tokenizer, args.messages_column) for split, data in raw.items()
        }
        longest = max((max(data["input_ids"], key=len, default=[]) for data in tokenized.values()), key=len)
        max_length = args.max_length or min(limit, max(len(longest), 2))
        return {split: truncate_conversations(data, max_length) for split, data in tokenized.items()}, max_length
    documents = {split: tokenize_documents(data, tokenizer, args.text_column) for split, data in raw.items()}
    sizing = documents.get("train", documents.get("validation"))
    total_tokens = sum(len(ids) for ids in sizing["input_ids"])
    max_length = args.max_length or min(limit, max(total_tokens, 2))
    features = {split: causal_lm_blocks(data, max_length, args.drop_last_block) for split, data in documents.items()}
    return features, max_length


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
    chat = task == "causal-lm" and any(args.messages_column in dataset.column_names for dataset in raw.values())
    if chat:
        columns = [args.messages_column]
    for split, dataset in raw.items():
        require_columns(dataset, columns, files[split], task)

    limit = default_max_length(config, tokenizer)
    if args.max_length is not None and args.max_length > getattr(config, "max_position_embeddings", args.max_length):
        raise ValueError(
            f"--max_length {args.max_length} is longer than the model's {config.max_position_embeddings} positions: "
            f"use --max_length {config.max_position_embeddings} or less."
        )
    max_length = args.max_length or limit
    model_overrides: dict = {}
    features: dict[str, datasets.Dataset] = {}
    if task == "causal-lm":
        features, max_length = causal_lm_features(raw, tokenizer, args, limit, chat)
        kind = "conversations of at most" if chat else "blocks of"
        logger.info("Causal LM on %s %d tokens (--max_length).", kind, max_length)
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
    if not features:
        features = {split: encode(dataset) for split, dataset in raw.items()}
    for split, dataset in features.items():
        if len(dataset) == 0:
            if chat:
                fix = f"its conversations have no assistant token within --max_length ({max_length}): raise it"
            elif task == "causal-lm":
                fix = f"it has fewer tokens than --max_length ({max_length}): lower it, add text or keep the last block"
                if not args.drop_last_block:
                    fix = "it has no text"
            else:
                fix = "add examples"
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


# ------------------------------------------------------------------------------------------------------- LoRA


def quantization_config(bits: str) -> BitsAndBytesConfig:
    """bitsandbytes' settings for a frozen base in `bits` ("4bit": NF4 with bf16 compute, as QLoRA; "8bit")."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"--qlora {bits} is not available here: bitsandbytes' {bits} weights need a CUDA GPU, and this machine "
            f"has none. Use --lora, which trains the same adapters on a full-precision base."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"--qlora {bits} needs bitsandbytes: pip install bitsandbytes.")
    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )  # fmt: skip


def lora_targets(model: torch.nn.Module, requested: str | None) -> list[str]:
    """The linear layer names LoRA adapts: those asked for (all must exist), or the default projections present."""
    linear_names = sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )
    if requested is None:
        targets = [name for name in LORA_TARGET_MODULES if name in linear_names]
        if not targets:
            raise ValueError(
                f"The model has none of LoRA's default target modules ({', '.join(LORA_TARGET_MODULES)}): name its "
                f"linear layers with --lora_target_modules, from {', '.join(linear_names)}."
            )
        return targets
    targets = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in targets if name not in linear_names]
    if unknown or not targets:
        raise ValueError(
            f"--lora_target_modules names {', '.join(unknown) or 'nothing'}, which the model has no linear layer "
            f"called; its linear layers are {', '.join(linear_names)}."
        )
    return targets


def add_lora(model: torch.nn.Module, args: FinetuneArguments, task: str, training_args: VaswaniTrainingArguments):
    """`model` wrapped by PEFT with LoRA adapters on `lora_targets`, only they (and a new classification head)
    trainable."""
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError as error:
        raise ValueError("--lora needs PEFT: pip install -e '.[train]' (or pip install peft).") from error
    if args.qlora:
        # Casts norms to fp32 and prepares inputs for checkpointing, as a quantized base needs.
        model = prepare_model_for_kbit_training(
            model, training_args.gradient_checkpointing, training_args.gradient_checkpointing_kwargs
        )
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=lora_targets(model, args.lora_target_modules), task_type=LORA_TASK_TYPES[task],
    )  # fmt: skip
    model = get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    if training_args.process_index == 0:
        print(
            f"LoRA (rank {args.lora_r}, alpha {args.lora_alpha:g}) on {', '.join(sorted(config.target_modules))}: "
            f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)"
        )
    return model


# ------------------------------------------------------------------------------------------------------- main


def save_final_model(trainer: VaswaniTrainer, output_dir: Path, merge: bool = False) -> Path:
    """The trained model and tokenizer to `output_dir/model`, written beside it first and then renamed into place,
    with the loss curve. With `merge` (LoRA), the adapter goes to `output_dir/adapter` and `model/` gets the plain
    model with the adapter merged into its weights."""
    final = output_dir / "model"
    if merge:
        save_folder(trainer, output_dir / "adapter")
        final_staging = output_dir / ".model.partial"
        if trainer.is_world_process_zero():
            shutil.rmtree(final_staging, ignore_errors=True)
            # W + (alpha / r) B A into each adapted layer; the PEFT wrappers go. (Training and evaluation are over.)
            merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
            merged.save_pretrained(final_staging)
            trainer.processing_class.save_pretrained(final_staging)
            write_loss_curve(trainer, final_staging, final)
            replace_folder(final_staging, final)
        trainer.accelerator.wait_for_everyone()
        return final
    return save_folder(trainer, final)


def save_folder(trainer: VaswaniTrainer, final: Path) -> Path:
    """`trainer.save_model` (the model, or a PEFT model's adapter alone, and the tokenizer) to `final`, atomically."""
    staging = final.parent / f".{final.name}.partial"
    if trainer.is_world_process_zero() and staging.exists():
        shutil.rmtree(staging)  # left by an interrupted run
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # on every process: FSDP gathers the shards; only the main process writes
    if trainer.is_world_process_zero():
        write_loss_curve(trainer, staging, final)
        replace_folder(staging, final)
    trainer.accelerator.wait_for_everyone()
    return final


def write_loss_curve(trainer: VaswaniTrainer, staging: Path, final: Path) -> None:
    title = f"fine-tuning {Path(trainer.args.output_dir).name}"
    if save_loss_curve(trainer.state.log_history, staging / "loss_curve.png", title=title) is not None:
        print(f"loss curve: {final / 'loss_curve.png'}")


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
    if args.qlora:
        model_overrides["quantization_config"] = quantization_config(args.qlora)
    try:
        model = TASK_MODELS[task].from_pretrained(
            args.model, **model_overrides, ignore_mismatched_sizes="num_labels" in model_overrides
        )
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise ValueError(
            f"{args.model} is a {config.model_type} model, which has no {task} form: pick another --task."
        ) from error
    if args.lora:
        model = add_lora(model, args, task, training_args)
    if training_args.include_num_input_tokens_seen in ("no", False):
        training_args.include_num_input_tokens_seen = "non_padding"  # for the tokens/s that TrainingProgress shows

    if task == "sequence-classification":
        collator, compute_metrics, reduce_logits = DataCollatorWithPadding(tokenizer), accuracy, _argmax
    else:
        if args.packing:
            collator = DataCollatorWithFlattening(separator_id=IGNORE_INDEX)
        else:  # pads input ids and, with -100, labels: blocks and conversations of unequal lengths batch together
            # on the right: a decoder's default positions count from its first token, padding included. (A copy: the
            # saved tokenizer keeps its own side, which batched generation relies on.)
            padding_tokenizer = copy.deepcopy(tokenizer)
            padding_tokenizer.padding_side = "right"
            collator = DataCollatorForSeq2Seq(padding_tokenizer, model=model if task == "seq2seq" else None)
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
        callbacks=[TrainingProgress(), *(callbacks or [])],
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
        results["train"] = train_output.metrics
        trainer.log_metrics("train", train_output.metrics)
        trainer.save_metrics("train", train_output.metrics)
    if "validation" in features:
        results["eval"] = trainer.evaluate()
        trainer.log_metrics("eval", results["eval"])
        trainer.save_metrics("eval", results["eval"])
    if "train" in features:  # saved after the last evaluation, so the loss curve ends with it (and --merge may unwrap)
        results["model_dir"] = str(save_final_model(trainer, Path(training_args.output_dir), merge=args.merge))
    results["log_history"] = list(trainer.state.log_history)
    return results


def _argmax(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)


if __name__ == "__main__":
    main(sys.argv[1:])
