"""The encoder-decoder family (the 2017 Transformer, T5- and BART-like): a bidirectional encoder stack and a causal
decoder stack whose blocks also cross-attend to the encoder output.

Example:
    >>> import torch
    >>> from vaswani import VaswaniSeq2SeqConfig, VaswaniForConditionalGeneration
    >>> config = VaswaniSeq2SeqConfig.from_preset("transformer-base", vocab_size=100, hidden_size=64,
    ...                                           num_attention_heads=4, intermediate_size=128,
    ...                                           encoder_layers=2, decoder_layers=2)
    >>> model = VaswaniForConditionalGeneration(config).eval()
    >>> model.generate(torch.tensor([[5, 6, 7, 2]]), max_new_tokens=4).shape
    torch.Size([1, 5])
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.loss.loss_utils import ForMaskedLMLoss
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.utils import ModelOutput, can_return_tuple

from .configuration import VaswaniSeq2SeqConfig
from .decoder import VaswaniDecoderModel
from .encoder import VaswaniEncoderModel
from .pretrained import (
    VaswaniPreTrainedModel,
    cache_keyword,
    cache_of,
    check_labels,
    merge_cache_arguments,
    slice_logits_to_keep,
    takes_the_cache_under_its_old_name,
)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher forcing: the decoder reads `[start] + labels[:-1]`, with ignored (-100) labels read as padding."""
    shifted = labels.new_full(labels.shape, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    ignored = shifted == -100
    if pad_token_id is None:
        # masked_fill would fail with an opaque TypeError on None; only ignored labels need a pad id.
        if ignored.any():
            raise ValueError(
                "labels contain -100 (ignored positions), which the decoder reads as padding, but pad_token_id is "
                "not set: set config.pad_token_id, or pass decoder_input_ids yourself."
            )
        return shifted
    return shifted.masked_fill(ignored, pad_token_id)


class VaswaniSeq2SeqModel(VaswaniPreTrainedModel):
    """Encoder and decoder stacks; returns the decoder's final hidden states and the encoder's output."""

    config_class = VaswaniSeq2SeqConfig

    def __init__(self, config: VaswaniSeq2SeqConfig) -> None:
        super().__init__(config)
        self.encoder = VaswaniEncoderModel(config.stack_config("encoder"), add_pooler=False)
        self.decoder = VaswaniDecoderModel(config.stack_config("decoder"))
        # `save_pretrained` finds the tied tensors it may drop through `_tied_weights_keys`, not through
        # `get_expanded_tied_weights_keys`: without it, saving a model with shared embeddings raises.
        self._tied_weights_keys = self.get_expanded_tied_weights_keys()
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        # The paper shares one embedding between encoder input and decoder input (section 3.4); configurable.
        tied = {}
        if self.config.share_encoder_decoder_embeddings:
            tied["decoder.embed_tokens.weight"] = "encoder.embed_tokens.weight"
        return tied

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embed_tokens = value

    def get_encoder(self) -> VaswaniEncoderModel:
        return self.encoder

    def get_decoder(self) -> VaswaniDecoderModel:
        return self.decoder

    @takes_the_cache_under_its_old_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        r"""
        Args:
            input_ids, attention_mask: the source tokens and their padding mask (1 real, 0 pad).
            decoder_input_ids, decoder_attention_mask: the target tokens read by the decoder (teacher forcing or
                generation) and their padding mask.
            encoder_outputs: a precomputed encoder output (`BaseModelOutput` or tuple); the encoder is skipped.
            cache: an `EncoderDecoderCache` (decoder self-attention + cross-attention keys/values); `past_key_values`,
                its name before transformers 5.24, is accepted too.
        """
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "An encoder-decoder model needs decoder inputs: pass decoder_input_ids (or decoder_inputs_embeds), "
                "or labels to VaswaniForConditionalGeneration, which shifts them into decoder_input_ids."
            )
        # The stacks are built from copies of this config (`stack_config`), so switches set on it after loading
        # (`model.config.output_attentions = True`, the Trainer's `use_cache = False`) must be passed on explicitly.
        for switch in ("output_attentions", "output_hidden_states"):
            if kwargs.get(switch) is None:
                kwargs[switch] = getattr(self.config, switch, False)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
        elif not isinstance(encoder_outputs, ModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            position_ids=decoder_position_ids,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=merge_cache_arguments(cache, past_key_values),
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **cache_keyword(cache_of(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, GenerationMixin):
    """Sequence-to-sequence model with an LM head: translation, summarization, `generate()` with beam search.

    `labels` are shifted right into `decoder_input_ids` (starting with `decoder_start_token_id`) and give the
    token-level cross-entropy; -100 labels are ignored.
    """

    config_class = VaswaniSeq2SeqConfig
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: VaswaniSeq2SeqConfig) -> None:
        super().__init__(config)
        self.model = VaswaniSeq2SeqModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self._tied_weights_keys = self.get_expanded_tied_weights_keys()  # for save_pretrained, as in the base model
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        tied = {f"model.{k}": f"model.{v}" for k, v in self.model.get_expanded_tied_weights_keys().items()}
        if self.config.tie_word_embeddings:
            source = "encoder" if self.config.share_encoder_decoder_embeddings else "decoder"
            tied["lm_head.weight"] = f"model.{source}.embed_tokens.weight"
        return tied

    def get_encoder(self) -> VaswaniEncoderModel:
        return self.model.encoder

    def get_decoder(self) -> VaswaniDecoderModel:
        return self.model.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self._decoder_start_token_id())

    def _decoder_start_token_id(self) -> int:
        start = self.config.decoder_start_token_id
        if start is None:
            raise ValueError(
                "decoder_start_token_id is not set, but it is needed to build decoder inputs from labels: set "
                "config.decoder_start_token_id (the paper and BART use the end-of-sequence id, T5 the pad id)."
            )
        return start

    @takes_the_cache_under_its_old_name
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        Args:
            labels: (batch, target tokens) target ids, -100 where ignored. Without decoder inputs they are
                shifted right into `decoder_input_ids`.
            logits_to_keep: compute logits for only the last `n` positions (0 keeps all; `generate` uses 1), or for
                the positions a 1D/2D index tensor names.
            Other arguments as in `VaswaniSeq2SeqModel.forward`.
        """
        if labels is not None:
            check_labels(labels, (labels.shape[0], None), "token ids of shape (batch, target tokens)", integer=True)
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=merge_cache_arguments(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            decoder_position_ids=decoder_position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        if self.config.scale_decoder_output:
            hidden_states = hidden_states * self.config.hidden_size**-0.5
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(
                    f"labels have shape {tuple(labels.shape)} but the decoder produced {tuple(logits.shape[:2])} "
                    f"positions; pass labels without decoder_input_ids, or both with the same length."
                )
            # Decoder inputs are already shifted, so position t predicts labels[t]: no further shift here.
            loss = ForMaskedLMLoss(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **cache_keyword(cache_of(outputs)),
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )


for _auto_class, _model_class in (
    ("AutoModel", VaswaniSeq2SeqModel),
    ("AutoModelForSeq2SeqLM", VaswaniForConditionalGeneration),
):
    _model_class.register_for_auto_class(_auto_class)
VaswaniSeq2SeqConfig.register_for_auto_class()

__all__ = ["VaswaniForConditionalGeneration", "VaswaniSeq2SeqModel", "shift_tokens_right"]
