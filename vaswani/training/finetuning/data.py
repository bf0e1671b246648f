"""The data side of `vaswani finetune`: data files read with `datasets` and turned into features for each task.

Text is cut into blocks, conversations are rendered with the chat template and only the assistant's tokens are
scored, classification labels are mapped onto the head, seq2seq sources and targets are tokenized.
"""

import logging
from functools import partial
from pathlib import Path

import datasets
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ...data.chat import IGNORE_INDEX, chat_example
from .arguments import DEFAULT_LENGTH_CAP, FILE_BUILDERS, FinetuneArguments

logger = logging.getLogger("vaswani.finetune")


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
    """Conversations rendered with the chat template, labelled on the assistant's tokens only (`vaswani.data.chat`)."""

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
