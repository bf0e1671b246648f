"""vaswani: the Transformer and its descendants as Hugging Face `transformers` models.

Importing the package registers every configuration and model with transformers' Auto classes:

    >>> import vaswani
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> config = AutoConfig.for_model("vaswani_decoder", num_hidden_layers=2)
    >>> model = AutoModelForCausalLM.from_config(config)
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .modeling import (
    VaswaniConfig,
    VaswaniDecoderConfig,
    VaswaniDecoderForSequenceClassification,
    VaswaniDecoderModel,
    VaswaniEncoderConfig,
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
    VaswaniForSequenceClassification,
    VaswaniForTokenClassification,
    VaswaniPreTrainedModel,
    VaswaniSeq2SeqConfig,
    VaswaniSeq2SeqModel,
)

__version__ = "0.1.0"

_AUTO_CLASSES = {
    VaswaniDecoderConfig: {
        AutoModel: VaswaniDecoderModel,
        AutoModelForCausalLM: VaswaniForCausalLM,
        AutoModelForSequenceClassification: VaswaniDecoderForSequenceClassification,
    },
    VaswaniEncoderConfig: {
        AutoModel: VaswaniEncoderModel,
        AutoModelForMaskedLM: VaswaniForMaskedLM,
        AutoModelForSequenceClassification: VaswaniEncoderForSequenceClassification,
        AutoModelForTokenClassification: VaswaniForTokenClassification,
        AutoModelForQuestionAnswering: VaswaniForQuestionAnswering,
    },
    VaswaniSeq2SeqConfig: {
        AutoModel: VaswaniSeq2SeqModel,
        AutoModelForSeq2SeqLM: VaswaniForConditionalGeneration,
    },
}
for _config_class, _models in _AUTO_CLASSES.items():
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    for _auto_class, _model_class in _models.items():
        _auto_class.register(_config_class, _model_class, exist_ok=True)

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
    "__version__",
]
