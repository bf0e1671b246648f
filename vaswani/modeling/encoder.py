"""The encoder-only family (BERT-like): a bidirectional `VaswaniStack` with task heads.

Example:
    >>> import torch
    >>> from vaswani import VaswaniEncoderConfig, VaswaniForMaskedLM
    >>> config = VaswaniEncoderConfig.from_preset("bert", vocab_size=100, hidden_size=64, num_hidden_layers=2)
    >>> model = VaswaniForMaskedLM(config).eval()
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 100])
"""

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    TokenClassifierOutput,
)
from transformers.utils import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .configuration import VaswaniEncoderConfig
from .layers import build_norm
from .pretrained import (
    VaswaniPreTrainedModel,
    VaswaniStack,
    check_inputs,
    check_labels,
    check_positions,
    default_position_ids,
    pool_hidden_states,
)


class VaswaniPooler(nn.Module):
    """BERT's pooler: dense + tanh over one vector per sequence (the first token, or the mean, per the config)."""

    def __init__(self, config: VaswaniEncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(pooled))


class VaswaniEncoderModel(VaswaniStack):
    """The bare bidirectional Transformer: final hidden states, and a pooled vector when `add_pooler` is set."""

    config_class = VaswaniEncoderConfig

    def __init__(self, config: VaswaniEncoderConfig, add_pooler: bool | None = None) -> None:
        super().__init__(config, is_causal=False)
        add_pooler = getattr(config, "add_pooler", False) if add_pooler is None else add_pooler
        self.pooler = VaswaniPooler(config) if add_pooler else None
        self.post_init()

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPooling:
        r"""
        Args:
            input_ids: (batch, tokens) token ids; or pass `inputs_embeds` (batch, tokens, hidden_size) instead.
            attention_mask: (batch, tokens), 1 for real tokens and 0 for padding.
            token_type_ids: (batch, tokens) segment ids, for configs with `type_vocab_size > 0` (BERT: 2).
            position_ids: (batch, tokens) positions, 0..tokens-1 by default.
        """
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, None)
        if token_type_ids is not None and self.token_type_embeddings is None:
            raise ValueError("token_type_ids were given but this model has no segment embeddings (type_vocab_size=0).")
        reference = input_ids if input_ids is not None else inputs_embeds
        if position_ids is None:
            position_ids = default_position_ids(reference.shape[1], None, reference.device)
        check_positions(self.config, position_ids, *reference.shape[:2])
        hidden_states = self.embed(input_ids, inputs_embeds, position_ids, token_type_ids)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden_states, attention_mask=attention_mask)
        hidden_states = self.run_blocks(hidden_states, mask, position_ids, None, **kwargs)
        pooled = None
        if self.pooler is not None:
            pooled = self.pooler(pool_hidden_states(hidden_states, attention_mask, self.config.classifier_pooling or "cls"))
        return BaseModelOutputWithPooling(last_hidden_state=hidden_states, pooler_output=pooled)


class VaswaniForMaskedLM(VaswaniPreTrainedModel):
    """Masked language model: predicts the original token at every position (BERT's head: dense, activation,
    norm, then a projection tied to the input embedding, with its own bias)."""

    config_class = VaswaniEncoderConfig
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: VaswaniEncoderConfig) -> None:
        super().__init__(config)
        self.model = VaswaniEncoderModel(config, add_pooler=False)
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act = ACT2FN[config.hidden_act]
        self.transform_norm = build_norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        r"""
        Args:
            labels: (batch, tokens) original token ids at masked positions and -100 elsewhere.
        """
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        hidden_states = self.transform_norm(self.transform_act(self.transform(outputs.last_hidden_state)))
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            check_labels(labels, logits.shape[:2], "token ids of shape (batch, tokens)", integer=True)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions)


class VaswaniForTokenClassification(VaswaniPreTrainedModel):
    """A label per token (named entities, part of speech): dropout and a linear classifier on every position."""

    config_class = VaswaniEncoderConfig

    def __init__(self, config: VaswaniEncoderConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = VaswaniEncoderModel(config, add_pooler=False)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> TokenClassifierOutput:
        r"""
        Args:
            labels: (batch, tokens) class ids, -100 for positions to ignore (padding, sub-word continuations).
        """
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            check_labels(labels, logits.shape[:2], "class ids of shape (batch, tokens)", integer=True)
            loss = self.loss_function(logits=logits, labels=labels, config=self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class VaswaniForQuestionAnswering(VaswaniPreTrainedModel):
    """Extractive question answering: start and end logits for the answer span."""

    config_class = VaswaniEncoderConfig

    def __init__(self, config: VaswaniEncoderConfig) -> None:
        super().__init__(config)
        self.model = VaswaniEncoderModel(config, add_pooler=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput:
        r"""
        Args:
            start_positions, end_positions: (batch,) token indices of the answer span; out-of-range ones are ignored.
        """
        outputs = self.model(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            for name, positions in (("start_positions", start_positions), ("end_positions", end_positions)):
                check_labels(positions, start_logits.shape[:1], f"{name}: token indices of shape (batch,)", integer=True)
            # Positions past the sequence (answers cut off by truncation) are ignored by transformers' QA loss.
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


for _auto_class, _model_class in (
    ("AutoModel", VaswaniEncoderModel),
    ("AutoModelForMaskedLM", VaswaniForMaskedLM),
    ("AutoModelForTokenClassification", VaswaniForTokenClassification),
    ("AutoModelForQuestionAnswering", VaswaniForQuestionAnswering),
):
    _model_class.register_for_auto_class(_auto_class)
VaswaniEncoderConfig.register_for_auto_class()

__all__ = [
    "VaswaniEncoderModel",
    "VaswaniForMaskedLM",
    "VaswaniForQuestionAnswering",
    "VaswaniForTokenClassification",
]
