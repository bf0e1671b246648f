"""Configurations, shared layers, the registry of position types (`positions.py`) and one module per model family."""

from .configuration import VaswaniConfig, VaswaniDecoderConfig, VaswaniEncoderConfig, VaswaniSeq2SeqConfig
from .decoder import VaswaniDecoderModel, VaswaniForCausalLM
from .encoder import (
    VaswaniEncoderModel,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
    VaswaniForTokenClassification,
)
from .heads import (
    VaswaniDecoderForSequenceClassification,
    VaswaniEncoderForSequenceClassification,
    VaswaniForSequenceClassification,
)
from .pretrained import VaswaniPreTrainedModel, cache_keyword, cache_of
from .seq2seq import VaswaniForConditionalGeneration, VaswaniSeq2SeqModel

__all__ = [
    "VaswaniConfig",
    "VaswaniDecoderConfig",
    "VaswaniDecoderForSequenceClassification",
    "VaswaniDecoderModel",
    "VaswaniEncoderForSequenceClassification",
    "VaswaniEncoderConfig",
    "VaswaniEncoderModel",
    "VaswaniForCausalLM",
    "VaswaniForConditionalGeneration",
    "VaswaniForMaskedLM",
    "VaswaniForQuestionAnswering",
    "VaswaniForSequenceClassification",
    "VaswaniForTokenClassification",
    "VaswaniPreTrainedModel",
    "VaswaniSeq2SeqConfig",
    "VaswaniSeq2SeqModel",
    "cache_keyword",
    "cache_of",
]
