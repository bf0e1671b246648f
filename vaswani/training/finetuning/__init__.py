"""`vaswani finetune`: fine-tune a saved vaswani model with transformers' `Trainer`: causal LM, sequence classification or seq2seq, from
local JSON lines / JSON / CSV / text files.

The task follows the saved architecture (`...ForCausalLM`, `...ForSequenceClassification`,
`...ForConditionalGeneration`); `--task` overrides it, e.g. to put a classification head on a pretrained decoder.
Every `TrainingArguments` flag passes through (`--learning_rate`, `--num_train_epochs`,
`--per_device_train_batch_size`, `--label_smoothing_factor`, `--eval_strategy`, `--save_steps`,
`--resume_from_checkpoint`, `--seed`, ...), and `--lr_scheduler_type paper` picks the paper's schedule (see
`vaswani.training.VaswaniTrainingArguments`).

    # causal LM on a text file (paragraphs are documents), with the paper's recipe
    vaswani finetune --model my-decoder --train_file train.txt --validation_file valid.txt \\
        --output_dir out --lr_scheduler_type paper --warmup_steps 4000 --label_smoothing_factor 0.1
    # sequence classification from JSON lines {"text": ..., "label": ...}
    vaswani finetune --model my-encoder --task sequence-classification --train_file train.jsonl \\
        --validation_file valid.jsonl --output_dir out --eval_strategy epoch --num_train_epochs 3
    # seq2seq from CSV with columns text,target; two processes (DDP) on one machine
    torchrun --nproc_per_node 2 -m vaswani finetune --model my-seq2seq --train_file train.csv --output_dir out
    # chat: LoRA on conversations ({"messages": [{"role": ..., "content": ...}, ...]} per line), merged afterwards
    vaswani finetune --model my-chat-model --train_file chats.jsonl --output_dir out --lora --merge

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
`accelerate launch ... -m vaswani finetune` (DDP, or FSDP on GPUs; configs in docs/accelerate).
"""

import sys

from .arguments import FinetuneArguments, parse_args
from .data import prepare_features
from .run import finetune

__all__ = ["FinetuneArguments", "finetune", "main", "parse_args", "prepare_features"]


def main(argv: list[str]) -> int:
    """`vaswani finetune ARGV...`: run `finetune(argv)`; 0 when done, 2 (with the reason on stderr) for bad input.

    Example:
        >>> main(["--model", "my-decoder", "--train_file", "train.txt", "--output_dir", "out"])  # doctest: +SKIP
        0
    """
    try:
        finetune(argv)
    except ValueError as error:  # FinetuneArguments' checks and the data's: a message that names the fix
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
