"""`resize_token_embeddings` behaves as on transformers' own models: every family and head accepts and predicts the
new token ids, tied output projections stay tied, untied ones grow with the input embedding, and the new rows are what
transformers' own BART, T5, LLaMA, GPT-2 and BERT get for the same weights (with and without `mean_resizing`).
"""

import pytest
import torch
from conftest import TOLERANCE, build_model, random_ids, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from test_conversion_parity import tiny_bart, tiny_bert, tiny_decoder, tiny_gpt2, tiny_t5
from transformers import BartForConditionalGeneration, BertForMaskedLM, LlamaForCausalLM

from vaswani import (
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForQuestionAnswering,
    VaswaniForSequenceClassification,
    VaswaniForTokenClassification,
    VaswaniSeq2SeqModel,
)
from vaswani.conversion.checkpoints import from_transformers

OLD_VOCAB, NEW_VOCAB = 64, 75  # tiny configs' vocabulary, and one grown by 11 tokens
REFERENCES = {
    "bart": lambda: tiny_bart(BartForConditionalGeneration, scale_embedding=False),
    "t5": lambda: tiny_t5("relu"),
    "llama-untied": lambda: tiny_decoder(LlamaForCausalLM),
    "gpt2-tied": tiny_gpt2,
    "bert-mlm": lambda: tiny_bert(BertForMaskedLM),
}


def ids_with_new_tokens(batch: int = 2, length: int = 6) -> torch.Tensor:
    """Token ids whose last two columns are among the added tokens."""
    ids = random_ids(batch, length)
    ids[:, -2:] = torch.tensor([NEW_VOCAB - 1, OLD_VOCAB])
    return ids


def run(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(ids, decoder_input_ids=ids.flip(-1)).logits
        return model(ids).logits


# Without mean_resizing the new rows come from each model's own init: T5's scales by initializer_factor, which has no
# vaswani counterpart, so T5 is compared with mean_resizing only.
ORACLE_CASES = [
    pytest.param(name, mean_resizing, id=f"{name}-{'mean_resizing' if mean_resizing else 'normal_init'}")
    for name in REFERENCES
    for mean_resizing in (True, False)
    if mean_resizing or not name.startswith("t5")
]


@pytest.mark.parametrize("name, mean_resizing", ORACLE_CASES)
def test_resized_model_matches_transformers_resized_model(name, mean_resizing):
    reference = REFERENCES[name]()
    converted = from_transformers(reference).eval()
    for model in (reference, converted):
        torch.manual_seed(0)  # both draw the new rows from the same generator state
        model.resize_token_embeddings(NEW_VOCAB, mean_resizing=mean_resizing)
        assert model.config.vocab_size == NEW_VOCAB
    ids = ids_with_new_tokens()
    expected, actual = run(reference, ids), run(converted, ids)
    assert actual.shape[-1] == NEW_VOCAB
    assert (actual - expected).abs().max().item() <= TOLERANCE


SEQ2SEQ_SHARING = {
    "shared-tied": dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=True),
    "shared-untied": dict(share_encoder_decoder_embeddings=True, tie_word_embeddings=False),
    "unshared-tied": dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=True),
    "unshared-untied": dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=False),
    "lm_head_bias": dict(lm_head_bias=True),
}
HEADS = {
    "causal_lm-tied": (VaswaniForCausalLM, tiny_decoder_config(tie_word_embeddings=True)),
    "causal_lm-untied": (VaswaniForCausalLM, tiny_decoder_config(tie_word_embeddings=False)),
    "decoder-classifier": (VaswaniForSequenceClassification, tiny_decoder_config()),
    "masked_lm": (VaswaniForMaskedLM, tiny_encoder_config()),
    "encoder-classifier": (VaswaniForSequenceClassification, tiny_encoder_config()),
    "token_classifier": (VaswaniForTokenClassification, tiny_encoder_config()),
    "question_answering": (VaswaniForQuestionAnswering, tiny_encoder_config()),
    "seq2seq-model": (VaswaniSeq2SeqModel, tiny_seq2seq_config()),
    **{
        f"seq2seq-{name}": (VaswaniForConditionalGeneration, tiny_seq2seq_config(**flags))
        for name, flags in SEQ2SEQ_SHARING.items()
    },
}


@pytest.mark.parametrize("mean_resizing", [True, False], ids=["mean_resizing", "normal_init"])
@pytest.mark.parametrize("head", list(HEADS))
def test_every_head_follows_a_resize(head, mean_resizing):
    model_class, config = HEADS[head]
    model = build_model(model_class, config)
    old_ids = random_ids(2, 6)
    before = run(model, old_ids) if hasattr(model, "lm_head") else None
    tied_before = set(model.all_tied_weights_keys)
    model.resize_token_embeddings(NEW_VOCAB, mean_resizing=mean_resizing)

    # Every token embedding and the LM head (weight and bias) have a row per token of the new vocabulary.
    for name, parameter in model.named_parameters():
        if name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            assert parameter.shape[0] == NEW_VOCAB, name
    assert model.config.vocab_size == NEW_VOCAB
    # Ties survive the resize: tied tensors are one tensor.
    assert {target for target in model.all_tied_weights_keys} == tied_before
    for target, source in model.all_tied_weights_keys.items():
        assert model.get_parameter(target) is model.get_parameter(source), f"{target} is no longer tied to {source}"
    # New ids are accepted everywhere (the encoder's and the decoder's checks follow), old tokens keep their outputs.
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            outputs = model(ids_with_new_tokens(), decoder_input_ids=ids_with_new_tokens().flip(-1))
        else:
            outputs = model(ids_with_new_tokens())
    assert torch.isfinite(outputs[0]).all()
    if before is not None:
        after = run(model, old_ids)
        assert after.shape[-1] == NEW_VOCAB
        assert (after[..., :OLD_VOCAB] - before).abs().max().item() <= TOLERANCE


def test_generate_reads_added_tokens_on_both_sides_after_a_resize():
    model = build_model(VaswaniForConditionalGeneration, tiny_seq2seq_config(share_encoder_decoder_embeddings=False))
    model.resize_token_embeddings(NEW_VOCAB)
    source = ids_with_new_tokens()
    decoder_start = torch.tensor([[2, NEW_VOCAB - 1]] * 2)  # the decoder reads an added token too
    settings = dict(decoder_input_ids=decoder_start, max_new_tokens=4, do_sample=False, eos_token_id=None)
    cached = model.generate(source, **settings)
    uncached = model.generate(source, use_cache=False, **settings)
    assert cached.shape == (2, 6)
    assert cached.tolist() == uncached.tolist()
