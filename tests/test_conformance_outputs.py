"""Output conformance: `output_attentions`, `output_hidden_states` and cross-attentions behave as in transformers' own
models (Llama, GPT-2, BERT, BART and T5 with the same weights, the oracle), through `forward` and `generate`, whether
asked for per call or on the config; and left padding gives the unpadded result in every family.

Only eager attention can return attention probabilities; with sdpa transformers' models return none (and warn), and
so do ours. Hidden states come from every backend.
"""

import pytest
import torch
import transformers
from conftest import (
    POSITION_TYPES,
    build_model,
    random_ids,
    tiny_decoder_config,
    tiny_encoder_config,
    tiny_seq2seq_config,
)
from packaging import version

from vaswani import (
    VaswaniDecoderConfig,
    VaswaniEncoderConfig,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniSeq2SeqConfig,
)
from vaswani.conversion.checkpoints import to_transformers
from vaswani.modeling.layers import positions_from_mask

SHAPE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64, initializer_range=0.2)
ORACLES = {
    # name: (our class, our config in the shape of transformers' model)
    "llama": (
        VaswaniForCausalLM,
        lambda: VaswaniDecoderConfig.from_preset(
            "llama", **SHAPE, num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
        ),
    ),
    "gpt2": (
        VaswaniForCausalLM,
        lambda: VaswaniDecoderConfig.from_preset(
            "gpt2",
            **SHAPE,
            num_hidden_layers=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "bert": (
        VaswaniForMaskedLM,
        lambda: VaswaniEncoderConfig.from_preset(
            "bert", **SHAPE, num_hidden_layers=2, max_position_embeddings=64, pad_token_id=0
        ),
    ),
    "bart": (
        VaswaniForConditionalGeneration,
        lambda: VaswaniSeq2SeqConfig.from_preset(
            "bart",
            **SHAPE,
            encoder_layers=2,
            decoder_layers=2,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
    ),
    "t5": (
        VaswaniForConditionalGeneration,
        lambda: VaswaniSeq2SeqConfig.from_preset(
            "t5", **SHAPE, encoder_layers=2, decoder_layers=2, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0
        ),
    ),
}
# Every tuple a model can return: per-layer hidden states and attention probabilities of each stack.
RECORDED = (
    "hidden_states",
    "attentions",
    "encoder_hidden_states",
    "encoder_attentions",
    "decoder_hidden_states",
    "decoder_attentions",
    "cross_attentions",
)


def oracle_pair(name: str, attn_implementation: str):
    model_class, make_config = ORACLES[name]
    ours = build_model(model_class, make_config(), attn_implementation)
    theirs = to_transformers(ours)
    theirs.set_attn_implementation(attn_implementation)
    return ours, theirs


def model_inputs(model) -> dict[str, torch.Tensor]:
    input_ids = random_ids(2, 7)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = random_ids(2, 4, seed=1)
    return inputs


# transformers' T5 records no attentions before 5.20 (5.16-5.19 checked; ours records them, which the eager case below
# asserts): there the oracle cannot speak for those outputs.
T5_ATTENTIONS = {"encoder_attentions", "decoder_attentions", "cross_attentions"}
ORACLE_GAPS = {"t5": T5_ATTENTIONS} if version.parse(transformers.__version__).release < (5, 20) else {}


def assert_same_recorded_outputs(actual, expected, gaps: set[str] = frozenset()) -> None:
    """Every recorded tuple is present in both or neither, with the same number of equal tensors. (An empty tuple is
    nothing recorded: GPT-2 returns one for the cross-attentions it does not have.) `gaps`: outputs the reference
    does not record in the installed release, not compared."""
    compared = 0
    for key in RECORDED:
        ours, theirs = actual.get(key) or None, expected.get(key) or None
        if key in gaps and theirs is None:
            continue
        assert (ours is None) == (theirs is None), f"{key}: ours {ours is not None}, transformers' {theirs is not None}"
        if ours is None:
            continue
        assert len(ours) == len(theirs), f"{key}: {len(ours)} tensors, transformers' model returns {len(theirs)}"
        for layer, (mine, reference) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(
                mine, reference, msg=lambda message, key=key, layer=layer: f"{key}[{layer}]: {message}"
            )
            compared += 1
    assert compared, "nothing was recorded"


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("oracle", ORACLES)
def test_recorded_outputs_match_transformers(oracle, attn_implementation):
    ours, theirs = oracle_pair(oracle, attn_implementation)
    inputs = model_inputs(ours)
    with torch.no_grad():
        actual = ours(**inputs, output_attentions=True, output_hidden_states=True)
        expected = theirs(**inputs, output_attentions=True, output_hidden_states=True)
    torch.testing.assert_close(actual.logits, expected.logits)
    assert_same_recorded_outputs(actual, expected, ORACLE_GAPS.get(oracle, set()))
    if attn_implementation == "eager":
        assert all(len(actual[key]) for key in RECORDED if key.endswith("attentions") and key in actual)


@pytest.mark.parametrize("oracle", ["llama", "gpt2", "bert", "bart"])
def test_output_switches_on_the_config_act_as_in_transformers(oracle):
    """`model.config.output_attentions = True` (as transformers' common tests and many scripts do) records the same
    outputs as transformers' model; for an encoder-decoder it must reach both stacks, as in BART. (T5 is no oracle
    here: its encoder keeps a private copy of the config and ignores the switches.)"""
    ours, theirs = oracle_pair(oracle, "eager")
    for model in (ours, theirs):
        model.config.output_attentions = model.config.output_hidden_states = True
    inputs = model_inputs(ours)
    with torch.no_grad():
        assert_same_recorded_outputs(ours(**inputs), theirs(**inputs))


def test_use_cache_off_on_the_config_returns_no_cache_as_bart_does():
    """The Trainer sets `model.config.use_cache = False`; the decoder stack of an encoder-decoder must follow it."""
    ours, bart = oracle_pair("bart", "eager")
    for model in (ours, bart):
        model.config.use_cache = False
    inputs = model_inputs(ours)
    with torch.no_grad():
        assert bart(**inputs).past_key_values is None
        assert ours(**inputs).past_key_values is None


@pytest.mark.parametrize("num_beams", [1, 2], ids=["greedy", "beam"])
@pytest.mark.parametrize("oracle", ["llama", "bart", "t5"])
def test_generate_returns_the_attentions_and_hidden_states_of_transformers(oracle, num_beams):
    ours, theirs = oracle_pair(oracle, "eager")
    inputs = model_inputs(ours)
    inputs.pop("decoder_input_ids", None)
    options = dict(
        max_new_tokens=3,
        do_sample=False,
        num_beams=num_beams,
        return_dict_in_generate=True,
        output_scores=True,
        output_attentions=True,
        output_hidden_states=True,
        pad_token_id=ours.config.pad_token_id,
    )
    actual, expected = ours.generate(**inputs, **options), theirs.generate(**inputs, **options)
    assert torch.equal(actual.sequences, expected.sequences)
    for key in ("scores", *RECORDED):
        mine, reference = getattr(actual, key, None), getattr(expected, key, None)
        # Per generated step: a tensor (scores, encoder outputs) or a tuple of one tensor per layer.
        flatten = lambda steps: [t for step in steps for t in (step if isinstance(step, tuple) else (step,))]  # noqa: E731
        if key in ORACLE_GAPS.get(oracle, set()) and not flatten(reference or ()):
            assert flatten(mine or ()), f"{key}: not recorded"
            continue
        assert (mine is None) == (reference is None), key
        if mine is None:
            continue
        assert len(flatten(mine)) == len(flatten(reference)) > 0, key
        for step, (a, b) in enumerate(zip(flatten(mine), flatten(reference))):
            torch.testing.assert_close(a, b, msg=lambda message, key=key, step=step: f"{key}[{step}]: {message}")


FAMILIES = {
    "decoder": (VaswaniForCausalLM, tiny_decoder_config),
    "encoder": (VaswaniForMaskedLM, tiny_encoder_config),
    "seq2seq": (VaswaniForConditionalGeneration, tiny_seq2seq_config),
}


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_attentions_are_the_masked_probabilities_and_hidden_states_agree_across_backends(
    family, position_embedding_type
):
    """For the position types transformers has no model of: each recorded attention is a distribution over the keys
    that gives padding no weight, one per layer; hidden states (one per layer, plus the embeddings) are the same from
    eager and sdpa, and the last is the model's output."""
    model_class, make_config = FAMILIES[family]
    eager = build_model(model_class, make_config(position_embedding_type=position_embedding_type), "eager")
    sdpa = build_model(model_class, make_config(position_embedding_type=position_embedding_type), "sdpa")
    inputs = model_inputs(eager)
    with torch.no_grad():
        outputs = eager(**inputs, output_attentions=True, output_hidden_states=True)
        sdpa_outputs = sdpa(**inputs, output_hidden_states=True)
    layers = eager.config.num_hidden_layers
    prefix = "decoder_" if family == "seq2seq" else ""
    stacks = (
        {"": ("attentions", "hidden_states")}
        if family != "seq2seq"
        else {
            "encoder": ("encoder_attentions", "encoder_hidden_states"),
            "decoder": ("decoder_attentions", "decoder_hidden_states"),
        }
    )
    real_source_keys = inputs["attention_mask"].bool()
    for attentions_key, hidden_key in stacks.values():
        assert len(outputs[attentions_key]) == layers and len(outputs[hidden_key]) == layers + 1
        for probabilities in outputs[attentions_key]:
            torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))
            if attentions_key != "decoder_attentions":  # the source's padding mask applies to the source's keys
                assert (probabilities.permute(0, 3, 1, 2)[~real_source_keys] == 0).all()
        for eager_states, sdpa_states in zip(outputs[hidden_key], sdpa_outputs[hidden_key]):
            torch.testing.assert_close(eager_states, sdpa_states)
    if family == "seq2seq":
        assert len(outputs.cross_attentions) == layers
        for probabilities in outputs.cross_attentions:
            torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))
            assert (probabilities.permute(0, 3, 1, 2)[~real_source_keys] == 0).all()  # padded source keys
        torch.testing.assert_close(outputs.encoder_hidden_states[-1], outputs.encoder_last_hidden_state)
    else:
        last = eager.model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
        torch.testing.assert_close(outputs[f"{prefix}hidden_states"][-1], last)


# ------------------------------------------------------------------------------------------------- left padding

PAD = 32  # as transformers' own left-padding test


def left_pad(input_ids: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`input_ids` behind PAD padding tokens, their mask, and the position ids transformers derives from the mask
    (`generate` does the same for every model that accepts position ids)."""
    padded = torch.cat([torch.full((input_ids.shape[0], PAD), pad_token_id), input_ids], dim=1)
    mask = torch.cat([torch.zeros(input_ids.shape[0], PAD, dtype=torch.long), torch.ones_like(input_ids)], dim=1)
    position_ids = positions_from_mask(mask)
    return padded, mask, position_ids


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_left_padding_gives_the_unpadded_result_decoder(position_embedding_type, attn_implementation):
    config = tiny_decoder_config(position_embedding_type=position_embedding_type)
    model = build_model(VaswaniForCausalLM, config, attn_implementation)
    input_ids = random_ids(2, 6)
    padded, mask, position_ids = left_pad(input_ids, config.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits
        actual = model(padded, attention_mask=mask, position_ids=position_ids, use_cache=False).logits[:, PAD:]
    torch.testing.assert_close(actual, expected)
    unpadded_tokens = model.generate(input_ids, max_new_tokens=4, do_sample=False)[:, -4:]
    padded_tokens = model.generate(padded, attention_mask=mask, max_new_tokens=4, do_sample=False)[:, -4:]
    assert torch.equal(padded_tokens, unpadded_tokens)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_left_padding_gives_the_unpadded_result_encoder(position_embedding_type, attn_implementation):
    config = tiny_encoder_config(position_embedding_type=position_embedding_type)
    model = build_model(VaswaniForMaskedLM, config, attn_implementation)
    input_ids = random_ids(2, 6)
    padded, mask, position_ids = left_pad(input_ids, config.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids).logits
        actual = model(padded, attention_mask=mask, position_ids=position_ids).logits[:, PAD:]
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_left_padding_gives_the_unpadded_result_seq2seq(position_embedding_type, attn_implementation):
    """Left-padded decoder inputs (with position ids from their mask) for every position type; a left-padded source
    for the relative position types. As in BART and T5, the source has no position ids of its own, so absolute
    encoder positions (sinusoidal, learned) count the padding: sources are right-padded there."""
    config = tiny_seq2seq_config(position_embedding_type=position_embedding_type)
    model = build_model(VaswaniForConditionalGeneration, config, attn_implementation)
    source, target = random_ids(2, 6), random_ids(2, 5, seed=1)
    padded_target, target_mask, target_positions = left_pad(target, config.pad_token_id)
    with torch.no_grad():
        expected = model(source, decoder_input_ids=target, use_cache=False).logits
        actual = model(
            source,
            decoder_input_ids=padded_target,
            decoder_attention_mask=target_mask,
            decoder_position_ids=target_positions,
            use_cache=False,
        ).logits[:, PAD:]
    torch.testing.assert_close(actual, expected)
    if position_embedding_type in ("sinusoidal", "learned"):
        return
    padded_source, source_mask, _ = left_pad(source, config.pad_token_id)
    with torch.no_grad():
        actual = model(padded_source, attention_mask=source_mask, decoder_input_ids=target, use_cache=False).logits
    torch.testing.assert_close(actual, expected)
    unpadded_tokens = model.generate(source, max_new_tokens=4, do_sample=False)
    padded_tokens = model.generate(padded_source, attention_mask=source_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(padded_tokens, unpadded_tokens)
