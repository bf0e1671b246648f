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
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithPast
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration import VaswaniDecoderConfig
from .pretrained import (
    VaswaniPreTrainedModel,
    VaswaniStack,
    cache_keyword,
    cache_of,
    check_inputs,
    check_positions,
    default_position_ids,
    merge_cache_arguments,
    slice_logits_to_keep,
    takes_the_cache_under_its_old_name,
)


class VaswaniDecoderModel(VaswaniStack):
    """The bare causal Transformer: token ids in, final hidden states out. With `config.is_encoder_decoder` (the
    decoder side of `VaswaniSeq2SeqModel`) its blocks also cross-attend to `encoder_hidden_states`."""

    config_class = VaswaniDecoderConfig

    def __init__(self, config: VaswaniDecoderConfig) -> None:
        super().__init__(config, is_causal=True, has_cross_attention=config.is_encoder_decoder)
        self.post_init()

    @takes_the_cache_under_its_old_name
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        r"""
        Args:
            input_ids: (batch, tokens) token ids; or pass `inputs_embeds` (batch, tokens, hidden_size) instead.
            attention_mask: (batch, cached + new tokens) with 1 for tokens to attend to and 0 for padding.
            position_ids: (batch, tokens) positions; by default they continue after the cached tokens.
            cache: a transformers `Cache` (`DynamicCache`, `StaticCache`; `EncoderDecoderCache` for the decoder of an
                encoder-decoder) of earlier keys/values. `past_key_values`, its name before transformers 5.24, is
                accepted too.
            encoder_hidden_states, encoder_attention_mask: the encoder output and its padding mask, for
                cross-attention (encoder-decoder only).
            use_cache: return a cache for the next call (a new one if none was given).
        """
        cache = merge_cache_arguments(cache, past_key_values)
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, cache)
        if self.config.is_encoder_decoder and encoder_hidden_states is None:
            raise ValueError("The decoder of an encoder-decoder model needs encoder_hidden_states to cross-attend to.")
        if use_cache and cache is None:
            cache = (
                EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
                if self.config.is_encoder_decoder
                else DynamicCache(config=self.config)
            )
        self_attention_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        reference = input_ids if input_ids is not None else inputs_embeds
        if position_ids is None:
            position_ids = default_position_ids(reference.shape[1], self_attention_cache, reference.device)
        check_positions(self.config, position_ids, *reference.shape[:2])

        hidden_states = self.embed(input_ids, inputs_embeds, position_ids)
        # Positional: the cache argument is `past_key_values` before transformers 5.24 and `cache` from it on.
        causal_mask = create_causal_mask(self.config, hidden_states, attention_mask, self_attention_cache, position_ids)
        if encoder_hidden_states is not None:
            kwargs["encoder_hidden_states"] = encoder_hidden_states
            kwargs["encoder_attention_mask"] = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=hidden_states,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )
        hidden_states = self.run_blocks(hidden_states, causal_mask, position_ids, cache, **kwargs)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden_states, **cache_keyword(cache))


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

    @takes_the_cache_under_its_old_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""
        Args:
            labels: (batch, tokens) targets; the loss predicts token t+1 from tokens <= t, ignoring -100.
            logits_to_keep: compute logits for only the last `n` positions (0 keeps all); `generate` uses 1.
            Other arguments as in `VaswaniDecoderModel.forward`.
        """
        outputs: BaseModelOutputWithPastAndCrossAttentions = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=merge_cache_arguments(cache, past_key_values),
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
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **cache_keyword(cache_of(outputs)),
        )


for _auto_class, _model_class in (
    ("AutoModel", VaswaniDecoderModel),
    ("AutoModelForCausalLM", VaswaniForCausalLM),
):
    # Saved folders carry this code and an `auto_map`, so they load with trust_remote_code=True anywhere.
    _model_class.register_for_auto_class(_auto_class)
VaswaniDecoderConfig.register_for_auto_class()

__all__ = ["VaswaniDecoderModel", "VaswaniForCausalLM"]
