"""The decoder-only family (GPT / LLaMA-like): a causal `VaswaniStack` with a language-model or classification head.

Example:
    >>> import torch
    >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
    >>> config = VaswaniDecoderConfig.from_preset("llama", vocab_size=100, hidden_size=64, num_hidden_layers=2)
    >>> model = VaswaniForCausalLM(config).eval()
    >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    >>> out.shape
    torch.Size([1, 8])
"""

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration import VaswaniDecoderConfig
from .pretrained import (
    VaswaniPreTrainedModel,
    VaswaniStack,
    check_inputs,
    check_positions_in_range,
    default_position_ids,
)


class VaswaniDecoderModel(VaswaniStack):
    """The bare causal Transformer: token ids in, final hidden states (`BaseModelOutputWithPast`) out."""

    config_class = VaswaniDecoderConfig

    def __init__(self, config: VaswaniDecoderConfig) -> None:
        super().__init__(config, is_causal=True)

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            input_ids: (batch, tokens) token ids; or pass `inputs_embeds` (batch, tokens, hidden_size) instead.
            attention_mask: (batch, cached + new tokens) with 1 for tokens to attend to and 0 for padding.
            position_ids: (batch, tokens) positions; by default they continue after the cached tokens.
            past_key_values: a transformers `Cache` (`DynamicCache`, `StaticCache`) of earlier keys/values.
            use_cache: return a cache for the next call (a new `DynamicCache` if none was given).
        """
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, past_key_values)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if position_ids is None:
            position_ids = default_position_ids(length, past_key_values, device)
        check_positions_in_range(self.config, position_ids)

        hidden_states = self.embed(input_ids, inputs_embeds, position_ids)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = self.run_blocks(hidden_states, causal_mask, position_ids, past_key_values, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class VaswaniForCausalLM(VaswaniPreTrainedModel, GenerationMixin):
    """Causal language model: `VaswaniDecoderModel` plus an LM head; works with `generate()`.

    Example:
        >>> from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
        >>> model = VaswaniForCausalLM(VaswaniDecoderConfig.from_preset("gpt2", vocab_size=100, num_hidden_layers=2))
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> model(ids, labels=ids).loss  # shifted next-token cross-entropy; -100 labels are ignored
    """

    config_class = VaswaniDecoderConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: VaswaniDecoderConfig) -> None:
        super().__init__(config)
        self.model = VaswaniDecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        Args:
            labels: (batch, tokens) targets; the loss predicts token t+1 from tokens <= t, ignoring -100.
            logits_to_keep: compute logits for only the last `n` positions (0 keeps all); `generate` uses 1.
            Other arguments as in `VaswaniDecoderModel.forward`.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class VaswaniForSequenceClassification(VaswaniPreTrainedModel):
    """Sequence classifier on the last real token of each sequence (left or right padding alike).

    The last real token is read from `attention_mask` when given, else from `pad_token_id`.
    """

    config_class = VaswaniDecoderConfig

    def __init__(self, config: VaswaniDecoderConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = VaswaniDecoderModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutputWithPast:
        r"""
        Args:
            labels: (batch,) class ids (cross-entropy), or floats for regression (`num_labels=1`) and
                (batch, num_labels) multi-hot floats for multi-label classification.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.score(outputs.last_hidden_state)
        batch_size, length = logits.shape[:2]
        positions = torch.arange(length, device=logits.device)
        if attention_mask is not None and attention_mask.dim() == 2:
            # The rightmost attended position: right padding ends there, left padding ends at the last column.
            last_token = (positions * attention_mask[:, -length:].to(logits.device, torch.long)).argmax(-1)
        elif input_ids is not None and self.config.pad_token_id is not None:
            last_token = (positions * (input_ids != self.config.pad_token_id).to(logits.device, torch.long)).argmax(-1)
        else:
            last_token = torch.full((batch_size,), length - 1, device=logits.device)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last_token]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled_logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


for _auto_class, _model_class in (
    ("AutoModel", VaswaniDecoderModel),
    ("AutoModelForCausalLM", VaswaniForCausalLM),
    ("AutoModelForSequenceClassification", VaswaniForSequenceClassification),
):
    # Saved folders carry this code and an `auto_map`, so they load with trust_remote_code=True anywhere.
    _model_class.register_for_auto_class(_auto_class)
VaswaniDecoderConfig.register_for_auto_class()

__all__ = ["VaswaniDecoderModel", "VaswaniForCausalLM", "VaswaniForSequenceClassification"]
