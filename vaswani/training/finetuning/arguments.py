"""The flags of `vaswani finetune`: `FinetuneArguments` (model, data, LoRA) beside `VaswaniTrainingArguments`."""

from dataclasses import dataclass, field
from pathlib import Path

from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    HfArgumentParser,
    PretrainedConfig,
)

from ..trainer import VaswaniTrainingArguments

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
    """The command line `argv` as (`FinetuneArguments`, `VaswaniTrainingArguments`); `--help` lists both."""
    parser = HfArgumentParser(
        (FinetuneArguments, VaswaniTrainingArguments),
        prog="vaswani finetune",
        description="Fine-tune a saved model with transformers' Trainer: causal LM (text or chat), sequence "
        "classification or seq2seq, full or LoRA, on one process or under torchrun / accelerate launch -m vaswani.",
    )
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
