"""Training vaswani models with transformers' `Trainer`: the paper's recipe (`trainer.py`) and `vaswani finetune`
(`finetuning/`); chat data for fine-tuning is `vaswani.data.chat`.

Example:
    >>> from vaswani.training import VaswaniTrainer, VaswaniTrainingArguments
"""

from . import trainer
from .trainer import *  # noqa: F403  (the names trainer.__all__ lists)

__all__ = trainer.__all__
