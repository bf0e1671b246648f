"""The models under the transformers that is installed, on both sides of the 5.24 cache rename and down to the floor.

transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`. Before the models took
both names, `generate` under 5.24 passed `cache=` that they never saw, and every step decoded without its past. Below
5.14, transformers' sdpa integration had no `position_bias`, and ALiBi or relative-bias models silently lost their
positions on the default backend. These tests run the real thing under whatever release the environment holds (CI
runs them on the newest release and on the declared floor): a cached step must equal the uncached logits, a bias
must change the logits on every backend that accepts it, and a backend that cannot take it must be refused.
"""

import warnings

import pytest
import torch
from conftest import (
    FLEX_SHAPE,
    POSITION_TYPES,
    TOLERANCE,
    build_model,
    random_ids,
    tiny_decoder_config,
    tiny_seq2seq_config,
    with_attention_backend,
)
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    BartConfig,
    BartForConditionalGeneration,
    ContinuousBatchingConfig,
    DynamicCache,
    EncoderDecoderCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.masking_utils import eager_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.modeling import cache_of
from vaswani.modeling.layers import carries_position_bias, eager_attention_forward
from vaswani.modeling.positions import bias_free_position_types

STEPS = 4
BIAS_FREE_POSITION_TYPES = bias_free_position_types()
# fp32 logits of a 2-layer model: a cached step and a full recomputation differ only by summation order.
BIAS_TYPES = [kind for kind in POSITION_TYPES if kind not in BIAS_FREE_POSITION_TYPES]
INSTALLED_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def family_model(family: str, position_embedding_type: str, backend: str, **shape):
    if family == "decoder":
        return build_model(
            VaswaniForCausalLM, tiny_decoder_config(position_embedding_type=position_embedding_type, **shape), backend
        )
    config = tiny_seq2seq_config(position_embedding_type=position_embedding_type, **shape)
    return build_model(VaswaniForConditionalGeneration, config, backend)


def logits_of(model, tokens: torch.Tensor, source: torch.Tensor, **kwargs) -> torch.Tensor:
    if model.config.is_encoder_decoder:
        return model(input_ids=source, decoder_input_ids=tokens, **kwargs).logits
    return model(input_ids=tokens, **kwargs).logits


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_cached_steps_equal_uncached_logits(family, position_embedding_type, backend):
    """Step by step through the model's own forward, under the installed transformers' argument and field names."""
    model = family_model(family, position_embedding_type, backend)
    source, tokens = random_ids(2, 5, seed=1), random_ids(2, 3)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache()) if model.config.is_encoder_decoder else DynamicCache()
    new = tokens
    with torch.no_grad():
        for step in range(STEPS):
            outputs = (
                model(input_ids=source, decoder_input_ids=new, cache=cache, use_cache=True)
                if model.config.is_encoder_decoder
                else model(input_ids=new, cache=cache, use_cache=True)
            )
            # The cache comes back under the field the installed output classes have, and it is the one passed in.
            assert getattr(outputs, INSTALLED_CACHE_FIELD) is cache and cache_of(outputs) is cache
            uncached = logits_of(model, tokens, source, use_cache=False)[:, -1]
            difference = (outputs.logits[:, -1] - uncached).abs().max().item()
            assert difference <= TOLERANCE, f"step {step}: cached logits differ by {difference}"
            new = uncached.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, new], dim=-1)
    assert cache.get_seq_length() == tokens.shape[1] - 1


def old_cache_name_warnings(model, **inputs) -> list[str]:
    """The FutureWarnings a forward gives when the cache comes as `past_key_values`, with the class name taken out."""
    make_cache = inputs.pop("make_cache", DynamicCache)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(**inputs, past_key_values=make_cache(), use_cache=True)
    name = type(model).__name__
    return [str(w.message).replace(name, "<model>") for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("family", ["decoder", "seq2seq"])
def test_the_old_cache_name_warns_as_transformers_own_models_do(family):
    """transformers' own Llama and BART are the oracle: from 5.24 on they rename `past_key_values` to `cache` with a
    FutureWarning (`deprecate_kwarg`), before 5.24 it is the name `generate` passes and nothing is said. Ours say
    the same thing on whichever release is installed (transformers' common test `test_bc_cache_name_forward`)."""
    ids = random_ids(1, 4)
    if family == "decoder":
        ours = family_model("decoder", "rope", "sdpa")
        reference = LlamaForCausalLM(
            LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2)
        ).eval()
        inputs = dict(input_ids=ids)
    else:
        ours = build_model(VaswaniForConditionalGeneration, tiny_seq2seq_config(), "sdpa")
        reference = BartForConditionalGeneration(
            BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                       decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
        ).eval()
        inputs = dict(input_ids=ids, decoder_input_ids=ids[:, :2], make_cache=lambda: EncoderDecoderCache(
            DynamicCache(), DynamicCache()))
    expected = old_cache_name_warnings(reference, **inputs)
    if INSTALLED_CACHE_FIELD == "cache":
        assert expected, "transformers' own model no longer warns on `past_key_values`: what replaced the warning?"
    assert old_cache_name_warnings(ours, **inputs) == expected


def test_the_cache_is_accepted_under_its_old_name_and_refused_twice():
    model = family_model("decoder", "rope", "sdpa")
    ids = random_ids(1, 4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        new_name = model(ids, cache=DynamicCache(), use_cache=True)
        old_name = model(ids, past_key_values=DynamicCache(), use_cache=True)
        assert torch.equal(new_name.logits, old_name.logits)
        assert cache_of(old_name).get_seq_length() == 4
        # Both names at once is refused: transformers' own words from 5.24 on ("Both ... are set"), ours before.
        with pytest.raises(ValueError, match="Both `past_key_values` and `cache` are set|Pass the cache once"):
            model(ids, cache=DynamicCache(), past_key_values=DynamicCache())


def zeroed_bias_twin(model):
    """`model` with its position bias made zero: ALiBi slopes of 0, or an all-zero relative-bias table."""
    twin = with_attention_backend(model, model.config._attn_implementation)
    for module in twin.modules():
        if hasattr(module, "slopes"):
            module.slopes.zero_()
        if hasattr(module, "relative_attention_bias"):
            module.relative_attention_bias.weight.data.zero_()
    return twin


def register_backend(name: str, function) -> None:
    """A user's attention backend, with transformers' eager (additive, causal) mask, as its docs show."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, eager_mask)


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("position_embedding_type", BIAS_TYPES)
def test_the_position_bias_reaches_the_scores_on_every_backend_that_takes_it(
    position_embedding_type, backend, fresh_dynamo
):
    """The reproduction: under transformers <= 5.13 an ALiBi model on sdpa gave the same logits with its slopes
    zeroed (difference 0.0). Now every backend either changes the logits with the bias, matching eager, or is
    refused."""
    eager = family_model("decoder", position_embedding_type, "eager", **FLEX_SHAPE)
    if position_embedding_type == "relative_bias":  # its table starts near zero: make the bias matter
        for module in eager.modules():
            if hasattr(module, "relative_attention_bias"):
                torch.nn.init.normal_(module.relative_attention_bias.weight, std=2.0, generator=None)
    ids = random_ids(2, 8)
    if not carries_position_bias(backend):
        with pytest.raises(ValueError, match="does not take"):
            with_attention_backend(eager, backend)
        return
    model = with_attention_backend(eager, backend)
    with torch.no_grad():
        with_bias, without_bias, reference = (
            model(ids).logits,
            zeroed_bias_twin(model)(ids).logits,
            eager(ids).logits,
        )
    assert (with_bias - without_bias).abs().max().item() > 1e-2, f"{backend} ignores the position bias"
    assert (with_bias - reference).abs().max().item() <= 1e-4, f"{backend} disagrees with eager"


def test_sdpa_takes_the_position_bias_in_every_supported_transformers():
    """The declared floor (5.14) is the first release whose sdpa integration takes `position_bias`."""
    assert carries_position_bias("sdpa") and carries_position_bias("flex_attention")


@pytest.mark.parametrize("position_embedding_type", BIAS_TYPES)
def test_a_backend_that_would_drop_the_bias_is_refused_with_the_backends_that_can(position_embedding_type):
    def forgets_the_bias(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling)

    def keeps_the_bias(module, query, key, value, attention_mask, scaling=None, position_bias=None, **kwargs):
        seen.append(position_bias)
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, position_bias=position_bias)

    seen = []
    register_backend("test_forgets_the_bias", forgets_the_bias)
    register_backend("test_keeps_the_bias", keeps_the_bias)
    model = family_model("decoder", position_embedding_type, "eager")
    for backend in ("test_forgets_the_bias", "paged|eager", "flash_attention_2"):
        with pytest.raises(ValueError, match=r"does not take.*Use attn_implementation='eager' or 'sdpa'"):
            model.config._attn_implementation = backend  # as set_attn_implementation leaves it, without its checks
            model(random_ids(1, 4))
    model.config._attn_implementation = "test_keeps_the_bias"
    with torch.no_grad():
        custom = model(random_ids(1, 4)).logits
    assert seen and all(bias is not None for bias in seen)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        assert torch.allclose(custom, model(random_ids(1, 4)).logits, atol=1e-6)


def test_a_bias_free_model_runs_on_any_registered_backend():
    def plain(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling)

    register_backend("test_plain", plain)
    model = family_model("decoder", "rope", "eager")
    ids = random_ids(2, 5)
    with torch.no_grad():
        expected = model(ids).logits
        model.config._attn_implementation = "test_plain"
        assert torch.allclose(model(ids).logits, expected, atol=1e-6)


# ------------------------------------------------------------------------- transformers' continuous batching

CB_GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
# A paged cache sized for these prompts: sized from the machine's memory instead, setting it up takes 20 s on a CPU.
CB_SMALL = dict(
    continuous_batching_config=ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64), progress_bar=False
)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def generated_by_generate(model) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), generation_config=CB_GREEDY)[0, len(p) :].tolist() for p in PROMPTS]


def generated_by_generate_batch(model, backend: str) -> list[list[int]]:
    model.set_attn_implementation(backend)
    outputs = model.generate_batch(inputs=PROMPTS, generation_config=CB_GREEDY, **CB_SMALL)
    ordered = sorted(outputs.values(), key=lambda output: PROMPTS.index(list(output.prompt_ids)))
    return [list(output.generated_tokens) for output in ordered]


@pytest.mark.parametrize("backend", ["paged|sdpa", "paged|eager"])
@pytest.mark.parametrize("position_embedding_type", BIAS_FREE_POSITION_TYPES)
def test_generate_batch_gives_generates_tokens(position_embedding_type, backend):
    """What `transformers serve --continuous-batching` runs: paged attention over requests packed into one row."""
    model = family_model("decoder", position_embedding_type, "sdpa")
    expected = generated_by_generate(model)
    assert generated_by_generate_batch(model, backend) == expected


@pytest.mark.parametrize("position_embedding_type", BIAS_TYPES)
def test_generate_batch_refuses_a_position_bias(position_embedding_type):
    model = family_model("decoder", position_embedding_type, "sdpa")
    with pytest.raises(ValueError, match="continuous batching.*cannot apply"):
        model.generate_batch(inputs=PROMPTS, generation_config=CB_GREEDY, **CB_SMALL)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_set_attn_implementation_reaches_both_stacks_of_an_encoder_decoder(backend):
    """transformers 5.14 passed a new backend only to submodels whose config is of another class: the encoder and
    decoder stacks (configs of the model's class) kept the old one."""
    model = family_model("seq2seq", "rope", "sdpa" if backend == "eager" else "eager")
    model.set_attn_implementation(backend)
    stacks = [model.get_encoder(), model.get_decoder(), model.model, model]
    assert [stack.config._attn_implementation for stack in stacks] == [backend] * 4
