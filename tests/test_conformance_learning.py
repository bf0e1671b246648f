"""Choosing a position encoding gives a model that learns like transformers' own: an encoder-decoder with the paper's
sinusoidal positions learns string reversal as well as `BartForConditionalGeneration` trained by the same recipe.

The recipe is the textbook one, shortened to seconds: d_model 96, 2+2 layers, post-LN, ReLU, 4 heads, Adam, strings of
3-4 letters. The bar is BART's own score in the same run, not a fixed number.
"""

import torch
from transformers import BartConfig, BartForConditionalGeneration, PreTrainedModel

from vaswani import VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig

PAD, START, EOS, VOCAB = 0, 1, 2, 29  # three special tokens, then a-z
MIN_LENGTH, MAX_LENGTH = 3, 4
STEPS, BATCH, LEARNING_RATE, EVAL_SIZE = 150, 32, 2e-3, 100
SPECIAL = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=START, eos_token_id=EOS, decoder_start_token_id=START)


def reversal_batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded letter strings ending in EOS, their mask, and labels: the letters reversed, then EOS."""
    lengths = torch.randint(MIN_LENGTH, MAX_LENGTH + 1, (size,), generator=generator)
    letters = torch.randint(3, VOCAB, (size, MAX_LENGTH), generator=generator)
    source = torch.full((size, MAX_LENGTH + 1), PAD)
    labels = torch.full((size, MAX_LENGTH + 1), -100)
    for row, length in enumerate(lengths.tolist()):
        source[row, :length], source[row, length] = letters[row, :length], EOS
        labels[row, :length], labels[row, length] = letters[row, :length].flip(0), EOS
    return source, (source != PAD).long(), labels


def train_and_count_exact_matches(model: PreTrainedModel) -> int:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    model.train()
    for _ in range(STEPS):
        source, mask, labels = reversal_batch(BATCH, generator)
        loss = model(input_ids=source, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    source, mask, labels = reversal_batch(EVAL_SIZE, torch.Generator().manual_seed(1))
    generated = model.generate(source, attention_mask=mask, max_new_tokens=MAX_LENGTH + 2, do_sample=False, num_beams=1)
    matches = 0
    for row in range(EVAL_SIZE):
        expected = [token for token in labels[row].tolist() if token != -100]
        output = generated[row, 1:].tolist()  # after the start token
        matches += output[: len(expected)] == expected
    return matches


def test_sinusoidal_encoder_decoder_learns_string_reversal_like_bart():
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(
        BartConfig(
            d_model=96, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=192, decoder_ffn_dim=192, activation_function="relu", max_position_embeddings=16,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, forced_eos_token_id=None, **SPECIAL,
        )
    )  # fmt: skip
    bart_matches = train_and_count_exact_matches(bart)
    assert bart_matches >= EVAL_SIZE // 2, f"the recipe itself must work: BART got {bart_matches}/{EVAL_SIZE}"

    torch.manual_seed(0)
    # Only the position encoding is chosen; everything else (embedding scale, init) is left to the defaults.
    config = VaswaniSeq2SeqConfig(
        hidden_size=96, encoder_layers=2, decoder_layers=2, num_attention_heads=4, intermediate_size=192,
        hidden_act="relu", norm_position="post", position_embedding_type="sinusoidal", **SPECIAL,
    )  # fmt: skip
    matches = train_and_count_exact_matches(VaswaniForConditionalGeneration(config))
    assert matches >= 0.8 * bart_matches, f"sinusoidal: {matches}/{EVAL_SIZE} exact, BART: {bart_matches}/{EVAL_SIZE}"


def test_sinusoidal_positions_scale_embeddings_by_default_and_an_explicit_choice_is_kept(tmp_path):
    assert VaswaniSeq2SeqConfig(position_embedding_type="sinusoidal").embedding_scale is True
    assert VaswaniSeq2SeqConfig(position_embedding_type="learned").embedding_scale is False
    unscaled = VaswaniSeq2SeqConfig(position_embedding_type="sinusoidal", embedding_scale=False)
    unscaled.save_pretrained(tmp_path)
    assert VaswaniSeq2SeqConfig.from_pretrained(tmp_path).embedding_scale is False
