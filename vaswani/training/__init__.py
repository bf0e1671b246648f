"""Training vaswani models with transformers' `Trainer`: the paper's recipe (`trainer.py`), chat data for
fine-tuning (`chat_data.py`) and `vaswani finetune` (`finetuning/`).

Example:
    >>> from vaswani.training import VaswaniTrainer, VaswaniTrainingArguments
"""

from .trainer import (
    PAPER_SCHEDULER,
    TensorDataset,
    TrainingProgress,
    VaswaniTrainer,
    VaswaniTrainingArguments,
    describe_device,
    get_paper_schedule,
    save_loss_curve,
)

__all__ = [
    "PAPER_SCHEDULER",
    "TensorDataset",
    "TrainingProgress",
    "VaswaniTrainer",
    "VaswaniTrainingArguments",
    "describe_device",
    "get_paper_schedule",
    "save_loss_curve",
]
