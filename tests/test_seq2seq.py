"""The encoder-decoder family (the 2017 Transformer): teacher forcing shifts labels behind the start token; the
encoder runs once and cross-attention keys/values are projected once per sequence; cached generation (greedy and
beam search) is the uncached computation; the attention backends agree; the embedding-sharing flags tie exactly the
tensors they name, through save and load; the paper's presets have the paper's shape and size; bad input fails with a
`ValueError` that says what to pass.
"""

import pytest
import torch
from conftest import (
    FLEX_SHAPE,
    POSITION_TYPES,
    TOLERANCE,
    build_model,
    max_diff_where,
    padding_mask,
    random_ids,
    tiny_seq2seq_config,
    with_attention_backend,
)
from safetensors import safe_open
from transformers import AutoModel, AutoModelForSeq2SeqLM

from vaswani import VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig, VaswaniSeq2SeqModel
from vaswani.modeling.seq2seq import shift_tokens_right

SOURCE_LENGTH, TARGET_LENGTH, NEW_TOKENS = 9, 6, 6
PAD, START = 0, 2
# eos_token_id=None: no row stops early, so every comparison covers all NEW_TOKENS steps.
GREEDY = dict(
    do_sample=False,
    max_new_tokens=NEW_TOKENS,
    eos_token_id=None,
    return_dict_in_generate=True,
    output_logits=True,
)
BEAMS = dict(GREEDY, num_beams=4, num_return_sequences=2, output_scores=True)


def seq2seq(position_embedding_type: str = "sinusoidal", attn_implementation: str = "eager", **overrides):
    config = tiny_seq2seq_config(position_embedding_type=position_embedding_type, **overrides)
    return build_model(VaswaniForConditionalGeneration, config, attn_implementation)


def padded_source(lengths=(SOURCE_LENGTH, 5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded source ids (pad id 0 in the padding) and their attention mask."""
    mask = padding_mask(list(lengths), SOURCE_LENGTH, "right")
    return random_ids(len(lengths), SOURCE_LENGTH).masked_fill(mask == 0, PAD), mask


def targets(batch: int = 3, seed: int = 1) -> torch.Tensor:
    return random_ids(batch, TARGET_LENGTH, seed=seed)


# ------------------------------------------------------------------------------------------- teacher forcing


def test_shift_tokens_right_puts_the_start_token_first_and_reads_ignored_labels_as_padding():
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
    expected = torch.tensor([[START, 5, 6, 7], [START, 9, 10, PAD]])
    assert torch.equal(shift_tokens_right(labels, PAD, START), expected)


def test_labels_are_shifted_into_decoder_input_ids():
    model = seq2seq()
    source, mask = padded_source()
    labels = targets()
    labels[2, 4:] = -100
    # By hand: the start token, then the labels but the last, with ignored labels read as padding.
    manual = torch.tensor([[START] + [PAD if t == -100 else t for t in row[:-1]] for row in labels.tolist()])
    with torch.no_grad():
        from_labels = model(source, attention_mask=mask, labels=labels).logits
        from_inputs = model(source, attention_mask=mask, decoder_input_ids=manual).logits
    assert torch.equal(from_labels, from_inputs)


def test_loss_is_cross_entropy_over_labels_that_are_not_minus_100():
    model = seq2seq()
    source, mask = padded_source()
    labels = targets()
    labels[1, 3:] = -100
    labels[2, 0] = -100
    with torch.no_grad():
        outputs = model(source, attention_mask=mask, labels=labels)
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(outputs.logits[keep], labels[keep])
    torch.testing.assert_close(outputs.loss, expected)
    # Guard: a loss that counted the ignored positions (as some token) would differ.
    counted = torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), labels.clamp(min=0).flatten())
    assert (counted - expected).abs() > 1e-3


def test_loss_backpropagates_to_every_parameter():
    model = seq2seq("relative_bias", share_encoder_decoder_embeddings=False, tie_word_embeddings=False).train()
    source, mask = padded_source()
    loss = model(source, attention_mask=mask, labels=targets()).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, f"{name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), f"{name} has a non-finite gradient"


@pytest.mark.parametrize("as_tuple", [False, True], ids=["model_output", "tuple"])
def test_precomputed_encoder_outputs_give_the_same_logits(as_tuple):
    model = seq2seq()
    source, mask = padded_source()
    decoder_input_ids = shift_tokens_right(targets(), PAD, START)
    encoder = model.get_encoder()
    assert encoder is model.model.get_encoder()
    with torch.no_grad():
        encoder_outputs = encoder(input_ids=source, attention_mask=mask)
        if as_tuple:
            encoder_outputs = (encoder_outputs.last_hidden_state,)
        expected = model(source, attention_mask=mask, decoder_input_ids=decoder_input_ids).logits
        actual = model(attention_mask=mask, encoder_outputs=encoder_outputs, decoder_input_ids=decoder_input_ids).logits
    assert torch.equal(actual, expected)


# -------------------------------------------------------------------------------------------------- generation


def count_projection_calls(model: VaswaniForConditionalGeneration, sublayer: str) -> list[int]:
    """Forward hooks counting calls of each decoder layer's `<sublayer>.k_proj` and `.v_proj` into the list returned."""
    calls = []
    for layer in model.get_decoder().layers:
        attention = getattr(layer, sublayer)
        for projection in (attention.k_proj, attention.v_proj):
            projection.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("settings", [GREEDY, BEAMS], ids=["greedy", "beam_search"])
def test_cross_attention_keys_and_values_are_projected_once_per_generate(settings):
    model = seq2seq()
    source, mask = padded_source()
    cross_calls = count_projection_calls(model, "cross_attn")
    self_calls = count_projection_calls(model, "self_attn")
    model.generate(source, attention_mask=mask, **settings)
    layers = model.config.decoder_layers
    assert len(cross_calls) == 2 * layers, "one key and one value projection per layer, not one per step"
    assert len(self_calls) == 2 * layers * NEW_TOKENS, "guard: the hooks see every decoding step"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_cached_greedy_generation_matches_uncached(position_embedding_type):
    model = seq2seq(position_embedding_type, "sdpa")
    source, mask = padded_source()
    cached = model.generate(source, attention_mask=mask, use_cache=True, **GREEDY)
    uncached = model.generate(source, attention_mask=mask, use_cache=False, **GREEDY)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    assert (cached.sequences[:, 0] == START).all()
    assert len(cached.logits) == len(uncached.logits) == NEW_TOKENS
    for step, (actual, expected) in enumerate(zip(cached.logits, uncached.logits)):
        difference = (actual - expected).abs().max().item()
        assert difference <= TOLERANCE, f"step {step}: logits differ by {difference}"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_cached_beam_search_matches_uncached(position_embedding_type):
    model = seq2seq(position_embedding_type, "sdpa")
    source, mask = padded_source()
    cached = model.generate(source, attention_mask=mask, use_cache=True, **BEAMS)
    uncached = model.generate(source, attention_mask=mask, use_cache=False, **BEAMS)
    assert cached.sequences.shape == (3 * BEAMS["num_return_sequences"], 1 + NEW_TOKENS)
    assert cached.sequences.tolist() == uncached.sequences.tolist()
    assert torch.allclose(cached.sequences_scores, uncached.sequences_scores, atol=TOLERANCE)
    for step, (actual, expected) in enumerate(zip(cached.scores, uncached.scores)):
        # Beam scores are log-probabilities, -inf for tokens no beam may take: compare where finite.
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(actual), finite), f"step {step}"
        assert (actual[finite] - expected[finite]).abs().max() <= TOLERANCE, f"step {step}"


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_padded_source_generates_what_each_source_generates_alone(position_embedding_type):
    model = seq2seq(position_embedding_type, "sdpa")
    lengths = (SOURCE_LENGTH, 5, 3)
    source, mask = padded_source(lengths)
    batched = model.generate(source, attention_mask=mask, **GREEDY)
    for row, length in enumerate(lengths):
        alone = model.generate(source[row : row + 1, :length], **GREEDY)
        assert batched.sequences[row].tolist() == alone.sequences[0].tolist(), f"row {row}"
        for step in range(NEW_TOKENS):
            difference = (batched.logits[step][row] - alone.logits[step][0]).abs().max().item()
            assert difference <= TOLERANCE, f"row {row}, step {step}: logits differ by {difference}"


# ------------------------------------------------------------------------------------------ attention backends


def backend_inputs(target_padding: bool = True) -> dict[str, torch.Tensor]:
    """A padded source and a target batch, right-padded or not."""
    source, mask = padded_source()
    decoder_mask = padding_mask(
        [TARGET_LENGTH, 4, 2] if target_padding else [TARGET_LENGTH] * 3, TARGET_LENGTH, "right"
    )
    return dict(
        input_ids=source,
        attention_mask=mask,
        decoder_input_ids=targets().masked_fill(decoder_mask == 0, PAD),
        decoder_attention_mask=decoder_mask,
    )


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_sdpa_matches_eager(position_embedding_type):
    eager = seq2seq(position_embedding_type, num_key_value_heads=2)
    sdpa = with_attention_backend(eager, "sdpa")
    inputs = backend_inputs()
    with torch.no_grad():
        expected = eager(**inputs).logits
        actual = sdpa(**inputs).logits
    assert max_diff_where(inputs["decoder_attention_mask"], actual, expected) <= TOLERANCE


@pytest.mark.parametrize("position_embedding_type", ["rope", "relative_bias"])
def test_flex_attention_matches_eager(position_embedding_type, fresh_dynamo):
    eager = seq2seq(position_embedding_type, num_key_value_heads=1, **FLEX_SHAPE)
    flex = with_attention_backend(eager, "flex_attention")
    # Source padding only: one forward compiles a flex kernel per mask kind (encoder, decoder, cross-attention), and
    # torch 2.13's CPU inductor generates uncompilable C++ when the decoder's causal mask also carries padding after
    # the encoder's biased kernel was compiled (alibi and relative_bias; not a vaswani bug).
    inputs = backend_inputs(target_padding=False)
    with torch.no_grad():
        expected = eager(**inputs).logits
        actual = flex(**inputs).logits
    assert max_diff_where(inputs["decoder_attention_mask"], actual, expected) <= TOLERANCE


def test_source_padding_changes_logits_far_beyond_the_parity_tolerance():
    """Guard for the parity tests above: a backend that ignored the source mask in cross-attention would fail them."""
    model = seq2seq("relative_bias")
    inputs = backend_inputs()
    with torch.no_grad():
        masked = model(**inputs).logits
        unmasked = model(**{**inputs, "attention_mask": torch.ones_like(inputs["attention_mask"])}).logits
    assert max_diff_where(inputs["decoder_attention_mask"][1:], masked[1:], unmasked[1:]) > 1000 * TOLERANCE


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_eager_attention_probabilities_have_the_right_shapes_and_skip_padding(side):
    model = seq2seq("alibi", encoder_layers=3, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=2)
    inputs = backend_inputs()
    with torch.no_grad():
        outputs = model(**inputs, output_attentions=True)
    batch, source_mask, target_mask = 3, inputs["attention_mask"].bool(), inputs["decoder_attention_mask"].bool()
    if side == "encoder":
        assert len(outputs.encoder_attentions) == 3
        expected_shapes = {tuple(probs.shape) for probs in outputs.encoder_attentions}
        assert expected_shapes == {(batch, 4, SOURCE_LENGTH, SOURCE_LENGTH)}
        attentions, key_mask, query_mask = outputs.encoder_attentions, source_mask, source_mask
    else:
        assert len(outputs.decoder_attentions) == len(outputs.cross_attentions) == 2
        assert {tuple(probs.shape) for probs in outputs.decoder_attentions} == {
            (batch, 2, TARGET_LENGTH, TARGET_LENGTH)
        }
        assert {tuple(probs.shape) for probs in outputs.cross_attentions} == {(batch, 2, TARGET_LENGTH, SOURCE_LENGTH)}
        attentions, key_mask, query_mask = outputs.cross_attentions, source_mask, target_mask
    for probs in attentions:
        sums = probs.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        # Real queries give no weight to padded keys (padded queries' rows are never used).
        on_padding = probs.masked_fill(key_mask[:, None, None, :], 0).masked_fill(~query_mask[:, None, :, None], 0)
        assert on_padding.abs().max() == 0


# ------------------------------------------------------------------------------------------ embedding sharing

# (share_encoder_decoder_embeddings, tie_word_embeddings) -> which of (encoder input, decoder input, output) share.
SHARING = {
    "share-and-tie": (True, True, {("encoder", "decoder"), ("decoder", "output"), ("encoder", "output")}),
    "share-only": (True, False, {("encoder", "decoder")}),
    "tie-only": (False, True, {("decoder", "output")}),
    "neither": (False, False, set()),
}
PAIRS = [("encoder", "decoder"), ("decoder", "output"), ("encoder", "output")]


def embedding_matrices(model: VaswaniForConditionalGeneration) -> dict[str, torch.Tensor]:
    return {
        "encoder": model.get_encoder().embed_tokens.weight,
        "decoder": model.get_decoder().embed_tokens.weight,
        "output": model.get_output_embeddings().weight,
    }


def shared_pairs(model: VaswaniForConditionalGeneration) -> set[tuple[str, str]]:
    matrices = embedding_matrices(model)
    return {(a, b) for a, b in PAIRS if matrices[a] is matrices[b]}


@pytest.mark.parametrize("share, tie, expected", SHARING.values(), ids=SHARING.keys())
def test_embedding_flags_tie_exactly_the_named_tensors_through_save_and_load(share, tie, expected, tmp_path):
    model = seq2seq(share_encoder_decoder_embeddings=share, tie_word_embeddings=tie)
    assert shared_pairs(model) == expected
    # Untied matrices start out different, so a load that tied them anyway would show.
    matrices = embedding_matrices(model)
    for a, b in set(PAIRS) - expected:
        assert not torch.equal(matrices[a], matrices[b]), f"{a} and {b} should start out different"

    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        stored = set(weights.keys())
    assert len(stored) == len(dict(model.named_parameters())), "each shared tensor is stored once"

    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert shared_pairs(loaded) == expected
    for side, matrix in embedding_matrices(loaded).items():
        assert torch.equal(matrix, matrices[side]), side
    inputs = backend_inputs()
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


# ------------------------------------------------------------------------------------------------ Auto classes


@pytest.mark.parametrize(
    "auto_class, expected_class",
    [(AutoModelForSeq2SeqLM, VaswaniForConditionalGeneration), (AutoModel, VaswaniSeq2SeqModel)],
    ids=["AutoModelForSeq2SeqLM", "AutoModel"],
)
def test_auto_class_loads_a_saved_folder_with_identical_outputs(auto_class, expected_class, tmp_path):
    model = seq2seq("relative_bias")
    model.save_pretrained(tmp_path)
    loaded = auto_class.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(loaded) is expected_class
    inputs = backend_inputs()
    with torch.no_grad():
        if expected_class is VaswaniForConditionalGeneration:
            assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
        else:  # the base model: the decoder's final hidden states
            assert torch.equal(loaded(**inputs).last_hidden_state, model.model(**inputs).last_hidden_state)
    if expected_class is VaswaniForConditionalGeneration:
        source, mask = padded_source()
        expected = model.generate(source, attention_mask=mask, **GREEDY)
        assert torch.equal(loaded.generate(source, attention_mask=mask, **GREEDY).sequences, expected.sequences)


# ----------------------------------------------------------------------------------------------------- presets

# Vaswani et al. 2017, table 3: (d_model, d_ff, heads, dropout, parameters) with 6 encoder and 6 decoder layers.
PAPER = {"transformer-base": (512, 2048, 8, 0.1, 65e6), "transformer-big": (1024, 4096, 16, 0.3, 213e6)}


@pytest.mark.parametrize("preset", list(PAPER))
def test_preset_has_the_papers_architecture(preset):
    d_model, d_ff, heads, dropout, _ = PAPER[preset]
    config = VaswaniSeq2SeqConfig.from_preset(preset)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (d_model, d_ff, heads)
    assert (config.encoder_layers, config.decoder_layers) == (6, 6)
    assert config.num_key_value_heads == heads and config.head_dim == 64  # plain multi-head attention, d_k = 64
    assert config.hidden_dropout == dropout
    assert config.norm_position == "post" and config.norm_type == "layernorm"  # section 3.1: LayerNorm(x + Sublayer(x))
    assert config.position_embedding_type == "sinusoidal"  # section 3.5
    assert config.hidden_act == "relu" and not config.gated_ffn  # section 3.3: max(0, xW1 + b1)W2 + b2
    assert config.embedding_scale  # section 3.4: embeddings multiplied by sqrt(d_model)
    # Section 3.4: one matrix for both embeddings and the pre-softmax projection.
    assert config.share_encoder_decoder_embeddings and config.tie_word_embeddings


@pytest.mark.parametrize("preset", list(PAPER))
def test_preset_parameter_count_is_within_3_percent_of_the_paper(preset):
    config = VaswaniSeq2SeqConfig.from_preset(preset, vocab_size=37000)  # the paper's shared BPE vocabulary (5.1)
    with torch.device("meta"):  # shapes only: no memory, no initialization cost
        model = VaswaniForConditionalGeneration(config)
    assert shared_pairs(model) == set(PAIRS)
    count = sum(parameter.numel() for parameter in model.parameters())  # parameters() yields a tied tensor once
    paper = PAPER[preset][-1]
    assert abs(count - paper) / paper <= 0.03, f"{count / 1e6:.1f}M parameters, the paper reports {paper / 1e6:.0f}M"


# --------------------------------------------------------------------------------------------------- bad input


def test_no_decoder_inputs_and_no_labels_raises():
    model = seq2seq()
    source, mask = padded_source()
    with pytest.raises(ValueError, match=r"decoder_input_ids.*labels"):
        model(source, attention_mask=mask)


def test_labels_without_decoder_start_token_id_raise():
    model = seq2seq(decoder_start_token_id=None)
    source, mask = padded_source()
    with pytest.raises(ValueError, match=r"decoder_start_token_id is not set.*config\.decoder_start_token_id"):
        model(source, attention_mask=mask, labels=targets())


def test_ignored_labels_without_pad_token_id_raise():
    model = seq2seq(pad_token_id=None)
    source, mask = padded_source()
    labels = targets()
    labels[0, -2:] = -100
    with pytest.raises(ValueError, match=r"-100.*pad_token_id is not set"):
        model(source, attention_mask=mask, labels=labels)
    # Without ignored labels no pad id is needed.
    assert torch.isfinite(model(source, attention_mask=mask, labels=targets()).loss)


BAD_LABELS = {
    "float": (targets().float(), r"token ids of shape \(batch, target tokens\).*integer dtype.*float32"),
    "bool": (targets() > 30, r"integer dtype.*torch\.bool"),
    "1d": (targets()[0], r"token ids of shape \(batch, target tokens\).*got shape \(6,\)"),
    "3d": (targets()[..., None], r"got shape \(3, 6, 1\)"),
}


@pytest.mark.parametrize("labels, match", BAD_LABELS.values(), ids=BAD_LABELS.keys())
def test_labels_of_wrong_dtype_or_shape_raise(labels, match):
    model = seq2seq()
    source, mask = padded_source()
    with pytest.raises(ValueError, match=match):
        model(source, attention_mask=mask, labels=labels)


def test_labels_longer_than_decoder_inputs_raise():
    model = seq2seq()
    source, mask = padded_source()
    decoder_input_ids = shift_tokens_right(targets(), PAD, START)
    with pytest.raises(ValueError, match=r"labels have shape \(3, 7\) but the decoder produced \(3, 6\)"):
        model(source, attention_mask=mask, decoder_input_ids=decoder_input_ids, labels=random_ids(3, 7))
