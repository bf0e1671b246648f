"""vLLM model classes for vaswani architectures that vLLM's stock Transformers backend cannot load as saved.

Imported by vLLM only (through `vaswani.vllm_plugin`), never by vaswani itself.
"""

import dataclasses

from torch import nn
from vllm.model_executor.models.transformers import TransformersForSequenceClassification


class VaswaniTransformersForSequenceClassification(TransformersForSequenceClassification):
    """vLLM's Transformers-backend classifier, reading vaswani's head as saved.

    The backend keeps the head as `classifier` but maps no checkpoint name onto it, so vaswani's `score.weight` would
    be "unexpected"; and it drops every `score.bias` (a bias some encoders save and do not use), where vaswani's
    encoder classifier uses its bias. Both are undone here: `score.` loads into `classifier.`, bias included.
    The backend also wraps the head to add a sequence axis, for heads that pick the first token themselves (RoBERTa's);
    vaswani's head is a plain Linear applied to the already pooled vector, so it is unwrapped.
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        mapper = self.hf_to_vllm_mapper
        self.hf_to_vllm_mapper = dataclasses.replace(
            mapper,
            orig_to_new_substr={key: value for key, value in mapper.orig_to_new_substr.items() if key != "score.bias"},
            orig_to_new_prefix={**mapper.orig_to_new_prefix, "score.": "classifier."},
        )
        if isinstance(self.classifier, nn.Linear):
            self.classifier.__class__ = nn.Linear  # the pooler holds this same module
