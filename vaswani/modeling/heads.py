"""Task heads that work on either stack: the encoder family's and the decoder family's sequence classifier.

Example:
    >>> import torch
    >>> from vaswani import VaswaniDecoderConfig, VaswaniForSequenceClassification
    >>> config = VaswaniDecoderConfig.from_preset("llama", vocab_size=100, num_hidden_layers=2, num_labels=3)
    >>> model = VaswaniForSequenceClassification(config)  # pools the last real token of each sequence
    >>> model(torch.tensor([[5, 6, 7]]), labels=torch.tensor([2])).logits.shape
    torch.Size([1, 3])
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.utils import can_return_tuple

from .configuration import VaswaniConfig, VaswaniDecoderConfig, VaswaniEncoderConfig
from .decoder import VaswaniDecoderModel
from .encoder import VaswaniEncoderModel
from .pretrained import (
    VaswaniPreTrainedModel,
    cache_keyword,
    cache_of,
    check_classification_labels,
    merge_cache_arguments,
    pool_hidden_states,
    takes_the_cache_under_its_old_name,
)


class VaswaniForSequenceClassification(VaswaniPreTrainedModel):
    """Sequence classification or regression over one pooled vector per sequence.

    The stack follows the config: a `VaswaniEncoderConfig` gets the bidirectional encoder (pooling `cls` by
    default, through BERT's pooler when `add_pooler`), a `VaswaniDecoderConfig` the causal decoder (pooling the
    last real token by default, found from `attention_mask`, else from `pad_token_id`). `classifier_pooling`
    (`cls`, `mean`, `last`) overrides the default. `AutoModelForSequenceClassification` builds the family's
    subclass (`VaswaniDecoderForSequenceClassification`, `VaswaniEncoderForSequenceClassification`).
    """

    config_class = VaswaniConfig

    def __init__(self, config: VaswaniConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.is_encoder = config.model_type == VaswaniEncoderConfig.model_type
        self.pooling = config.classifier_pooling or ("cls" if self.is_encoder else "last")
        self.model = VaswaniEncoderModel(config) if self.is_encoder else VaswaniDecoderModel(config)
        if getattr(self.model, "pooler", None) is not None and (config._attn_implementation or "").startswith("vllm"):
            # vLLM pools the final hidden states itself and feeds the classifier directly: BERT's pooler would be
            # skipped and every probability wrong.
            raise ValueError(
                "vLLM cannot serve this classifier: it uses BERT's pooler (add_pooler=True), which vLLM's pooling "
                "skips. Serve it with transformers or `vaswani serve`, or fine-tune a classifier with add_pooler=False."
            )
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        # Decoders follow LLaMA's `score` head without bias; encoders BERT's `classifier` with one.
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=self.is_encoder)
        self.post_init()

    @takes_the_cache_under_its_old_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        r"""
        Args:
            labels: (batch,) class ids; (batch,) floats for regression (`num_labels=1`); (batch, num_labels)
                floats for multi-label classification.
            token_type_ids: segment ids (encoders with `type_vocab_size > 0`).
            Other arguments as in the stack's `forward`.
        """
        if self.is_encoder:
            outputs = self.model(
                input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs
            )
        else:
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=merge_cache_arguments(cache, past_key_values),
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        pooled = getattr(outputs, "pooler_output", None)
        if pooled is None:
            if attention_mask is None and input_ids is not None and self.config.pad_token_id is not None:
                attention_mask = input_ids != self.config.pad_token_id
            pooled = pool_hidden_states(outputs.last_hidden_state, attention_mask, self.pooling)
        logits = self.score(self.dropout(pooled))
        loss = None
        if labels is not None:
            check_classification_labels(self.config, labels, logits.shape[0])
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **cache_keyword(cache_of(outputs)),
        )


class VaswaniDecoderForSequenceClassification(VaswaniForSequenceClassification):
    """`VaswaniForSequenceClassification` bound to the decoder config, for transformers' Auto classes."""

    config_class = VaswaniDecoderConfig


class VaswaniEncoderForSequenceClassification(VaswaniForSequenceClassification):
    """`VaswaniForSequenceClassification` bound to the encoder config, for transformers' Auto classes."""

    config_class = VaswaniEncoderConfig


for _model_class in (VaswaniDecoderForSequenceClassification, VaswaniEncoderForSequenceClassification):
    _model_class.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "VaswaniDecoderForSequenceClassification",
    "VaswaniEncoderForSequenceClassification",
    "VaswaniForSequenceClassification",
]
