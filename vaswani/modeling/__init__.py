"""Configurations, shared layers and one module per model family."""

from .configuration import VaswaniConfig, VaswaniDecoderConfig
from .decoder import VaswaniDecoderModel, VaswaniForCausalLM, VaswaniForSequenceClassification
from .pretrained import VaswaniPreTrainedModel

__all__ = [
    "VaswaniConfig",
    "VaswaniDecoderConfig",
    "VaswaniDecoderModel",
    "VaswaniForCausalLM",
    "VaswaniForSequenceClassification",
    "VaswaniPreTrainedModel",
]
