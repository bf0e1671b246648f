"""Training vaswani models with transformers' `Trainer`: the paper's recipe (`trainer.py`) and `vaswani finetune`
(`finetuning/`); chat data for fine-tuning is `vaswani.data.chat`.

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
