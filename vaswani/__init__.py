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
    AutoModelForSequenceClassification,
)

from .modeling import (
    VaswaniConfig,
    VaswaniDecoderConfig,
    VaswaniDecoderModel,
    VaswaniForCausalLM,
    VaswaniForSequenceClassification,
    VaswaniPreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(VaswaniDecoderConfig.model_type, VaswaniDecoderConfig, exist_ok=True)
AutoModel.register(VaswaniDecoderConfig, VaswaniDecoderModel, exist_ok=True)
AutoModelForCausalLM.register(VaswaniDecoderConfig, VaswaniForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(VaswaniDecoderConfig, VaswaniForSequenceClassification, exist_ok=True)

__all__ = [
    "VaswaniConfig",
    "VaswaniDecoderConfig",
    "VaswaniDecoderModel",
    "VaswaniForCausalLM",
    "VaswaniForSequenceClassification",
    "VaswaniPreTrainedModel",
    "__version__",
]
