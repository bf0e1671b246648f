"""ONNX Runtime generation from exported tiny models against the PyTorch models they came from: token-identical
(greedy, beam search, seeded sampling, stopping criteria; in the lean loop, which transformers calls through its
public `custom_generate` hook, in its fallback through `forward`, and in transformers' own loop), logits and caches
agree, the encoder graph emits the cross-attention cache the decoder reads (repeated per beam by the decoder), IO
binding writes the cache into preallocated buffers, and fp16 exports keep a half-precision cache.

The models are exported once per test session (onnx_cases.py). CUDA tests run only where onnxruntime has
the CUDA provider and torch sees a GPU.
"""

import functools
import inspect
import re

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from conftest import TOLERANCE, build_model, padding_mask, random_ids, tiny_decoder_config  # noqa: E402
from onnx_cases import (  # noqa: E402
    DECODERS,
    GQA_DECODER,
    HAS_CUDA,
    PAD,
    SEQ2SEQ,
    left_padded_prompts,
    right_padded_sources,
)
from transformers import (  # noqa: E402
    GenerationConfig,
    GenerationMixin,
    StoppingCriteria,
    StoppingCriteriaList,
    pipeline,
)
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.modeling_outputs import BaseModelOutput  # noqa: E402

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.export import export_onnx  # noqa: E402
from vaswani.modeling import cache_keyword  # noqa: E402
from vaswani.modeling.layers import positions_from_mask  # noqa: E402
from vaswani.runtime import (  # noqa: E402  # noqa: E402  # noqa: E402
    OrtModelForCausalLM,
    OrtModelForSeq2SeqLM,
    decoders,
    default_session_options,
    generation,
    held_cache,
    lean_steps,
)
from vaswani.runtime import gqa as gqa_runtime  # noqa: E402
from vaswani.runtime.decoders import gqa as gqa_decoder_runtime  # noqa: E402
from vaswani.runtime.decoders import openvino as openvino_decoder_runtime  # noqa: E402
from vaswani.runtime.decoders import portable as portable_decoder_runtime  # noqa: E402
from vaswani.runtime.generation import OrtModelForGeneration  # noqa: E402

pytest_plugins = ["onnx_cases"]  # the shared `tokenizer`, `exports` and `load` fixtures

NEW_TOKENS = 8
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu (CUDAExecutionProvider) and a CUDA GPU")
LOOPS = ["lean", "transformers"]
GREEDY_FIXED = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)  # every row runs every step


def counting(forward, calls: list):
    """`forward` that appends to `calls` at each call."""

    @functools.wraps(forward)  # transformers reads forward's signature
    def recording(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return forward(self, *args, **kwargs)

    return recording


@pytest.fixture
def loops(monkeypatch):
    """The decoding loop each generate() call of an ORT model took, told by public behaviour only: "lean" (generate
    was given `lean_sample` as `custom_generate`, and forward never ran: the lean loop drives the graph itself),
    "lean via forward" (`lean_sample` decoded through forward) or "transformers" (transformers' own loop). The lean
    loop must not silently fall back, nor transformers' loop be skipped."""
    runs, forward_calls = [], []
    generate = GenerationMixin.generate

    @functools.wraps(generate)
    def recording(self, *args, **kwargs):
        if not isinstance(self, OrtModelForGeneration):
            return generate(self, *args, **kwargs)
        forward_calls.clear()
        result = generate(self, *args, **kwargs)
        if kwargs.get("custom_generate") is type(self).lean_sample:
            runs.append("lean via forward" if forward_calls else "lean")
        else:
            runs.append("transformers")
        return result

    monkeypatch.setattr(GenerationMixin, "generate", recording)
    for ort_class in (OrtModelForCausalLM, OrtModelForSeq2SeqLM):
        monkeypatch.setattr(ort_class, "forward", counting(ort_class.forward, forward_calls))
    return runs


def generate_both(pytorch_model, ort_model, loop: str, seed: int = 0, **kwargs) -> tuple:
    """Generate with both models under the same seed; `loop` picks the ORT model's loop."""
    ort_model.fast_generation = loop == "lean"
    outputs = []
    for model in (pytorch_model, ort_model):
        torch.manual_seed(seed)
        outputs.append(model.generate(**kwargs))
    return tuple(outputs)


# -------------------------------------------------------------------------------------- decoder generation


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_of_a_left_padded_batch_matches_pytorch(load, loops, name, loop):
    pytorch_model, ort_model = load(OrtModelForCausalLM, f"decoder-{name}")
    input_ids, attention_mask = left_padded_prompts()
    expected, actual = generate_both(
        pytorch_model, ort_model, loop, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS
    )
    assert torch.equal(actual, expected)
    assert loops == [loop]


@pytest.mark.parametrize("name", DECODERS)
def test_beam_search_matches_pytorch(load, name):
    pytorch_model, ort_model = load(OrtModelForCausalLM, f"decoder-{name}")
    input_ids, attention_mask = left_padded_prompts()
    expected, actual = generate_both(
        pytorch_model,
        ort_model,
        "transformers",
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        num_beams=3,
        num_return_sequences=2,
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", DECODERS)
def test_seeded_sampling_matches_pytorch(load, loops, name, loop):
    """With the same global seed, equal distributions draw equal tokens: the logits agree to 1e-5, so the tokens
    must be identical."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, f"decoder-{name}")
    input_ids, attention_mask = left_padded_prompts()
    sampling = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW_TOKENS)
    expected, actual = generate_both(
        pytorch_model, ort_model, loop, input_ids=input_ids, attention_mask=attention_mask, **sampling
    )
    assert torch.equal(actual, expected)
    assert loops == [loop]
    # The premise: PyTorch and ORT see the same next-token logits along the way.
    with_logits = dict(sampling, return_dict_in_generate=True, output_logits=True)
    expected, actual = generate_both(
        pytorch_model, ort_model, "transformers", input_ids=input_ids, attention_mask=attention_mask, **with_logits
    )
    assert torch.equal(actual.sequences, expected.sequences)
    assert max((a - e).abs().max().item() for a, e in zip(actual.logits, expected.logits)) < TOLERANCE


class StopAtTokens(StoppingCriteria):
    """A custom criterion that ends each row on its own: once it generates the token chosen for that row."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] == self.tokens


@pytest.mark.parametrize("loop", LOOPS)
def test_stopping_criteria_are_honoured(load, loop):
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    prompt = dict(input_ids=input_ids, attention_mask=attention_mask)

    expected, actual = generate_both(pytorch_model, ort_model, loop, **prompt, max_length=input_ids.shape[1] + 3)
    assert actual.shape[1] == input_ids.shape[1] + 3
    assert torch.equal(actual, expected)

    # End of sequence: the token the first row generates third, so that row stops early and is padded after it.
    free_run, _ = generate_both(pytorch_model, ort_model, loop, **prompt, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    eos = int(free_run[0, input_ids.shape[1] + 2])
    expected, actual = generate_both(
        pytorch_model, ort_model, loop, **prompt, max_new_tokens=NEW_TOKENS, eos_token_id=eos
    )
    assert torch.equal(actual, expected)
    assert (expected[0, input_ids.shape[1] + 3 :] == PAD).all()

    # Row i stops at the token it generates in step i + 1 (or earlier, where that token comes up before).
    steps = torch.arange(free_run.shape[0]) + input_ids.shape[1] + 1
    criteria = StoppingCriteriaList([StopAtTokens(free_run[torch.arange(free_run.shape[0]), steps])])
    expected, actual = generate_both(
        pytorch_model,
        ort_model,
        loop,
        **prompt,
        max_new_tokens=NEW_TOKENS,
        stopping_criteria=criteria,
        eos_token_id=None,
    )
    assert torch.equal(actual, expected)
    assert expected.shape[1] < input_ids.shape[1] + NEW_TOKENS  # the criterion did stop generation


@pytest.mark.parametrize("loop", LOOPS)
def test_minimum_lengths_are_honoured(load, loops, loop):
    """min_new_tokens / min_length hold back an end-of-sequence token that would otherwise come early (the lean loop
    applies them in place of transformers' processors)."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    prompt = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS)
    free_run, _ = generate_both(pytorch_model, ort_model, loop, **prompt, eos_token_id=None)
    eos = int(free_run[0, input_ids.shape[1] + 1])  # row 0's second new token
    for minimum in (dict(min_new_tokens=NEW_TOKENS - 1), dict(min_length=input_ids.shape[1] + NEW_TOKENS - 1)):
        expected, actual = generate_both(pytorch_model, ort_model, loop, **prompt, eos_token_id=eos, **minimum)
        assert torch.equal(actual, expected)
        assert (expected[:, input_ids.shape[1] : -1] != eos).all()  # held back until the last step
    assert loops == [loop] * 3


@pytest.mark.parametrize("name", DECODERS)
def test_forward_with_cache_matches_pytorch_logits_and_cache(load, name):
    """The prompt of a left-padded batch, then two single-token steps through the returned cache."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, f"decoder-{name}")
    input_ids, attention_mask = left_padded_prompts()
    real = attention_mask.bool()
    # PyTorch's forward counts positions from the first (padding) column unless told; generate() passes positions
    # counted from the first real token, which the ORT model derives from the mask by itself.
    positions = positions_from_mask(attention_mask)
    expected = pytorch_model(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    actual = ort_model(input_ids, attention_mask=attention_mask)
    assert (actual.logits[real] - expected.logits[real]).abs().max() < TOLERANCE
    for step in range(2):
        next_ids = expected.logits[:, -1].argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_ids)], dim=-1)
        expected = pytorch_model(
            next_ids,
            attention_mask=attention_mask,
            position_ids=attention_mask.sum(-1, keepdim=True) - 1,
            past_key_values=expected.past_key_values,
            use_cache=True,
        )
        actual = ort_model(next_ids, attention_mask=attention_mask, past_key_values=actual.past_key_values)
        assert (actual.logits - expected.logits).abs().max() < TOLERANCE, f"step {step}"
    real = attention_mask.bool()
    for ort_layer, pytorch_layer in zip(actual.past_key_values.layers, expected.past_key_values.layers, strict=True):
        for ort_tensor, pytorch_tensor in (
            (ort_layer.keys, pytorch_layer.keys),
            (ort_layer.values, pytorch_layer.values),
        ):
            difference = (ort_tensor - pytorch_tensor).abs().amax(dim=(1, 3))  # (batch, positions)
            assert difference[real].max() < TOLERANCE


@pytest.mark.parametrize("logits_to_keep", [1, 2, 0, 99, torch.tensor([0, 4]), torch.tensor([-1, 1])], ids=str)
def test_forward_computes_only_the_logits_asked_for(load, logits_to_keep):
    """`logits_to_keep` as in transformers (the last n positions, 0 or more than there are for all, or a list of
    positions): ONNX Runtime's logits have PyTorch's shape and values, and the same cache."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids = random_ids(2, 5)
    expected = pytorch_model(input_ids, use_cache=True, logits_to_keep=logits_to_keep)
    actual = ort_model(input_ids, logits_to_keep=logits_to_keep)
    assert actual.logits.shape == expected.logits.shape
    assert (actual.logits - expected.logits).abs().max() < TOLERANCE
    keys = actual.past_key_values.layers[-1].keys
    assert (keys - expected.past_key_values.layers[-1].keys).abs().max() < TOLERANCE


@pytest.mark.parametrize("logits_to_keep", [-1, torch.tensor([5]), torch.tensor([[0]]), torch.tensor([0.0])], ids=str)
def test_forward_rejects_logits_positions_it_cannot_compute(load, logits_to_keep):
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    with pytest.raises(ValueError, match="logits_to_keep"):
        ort_model(random_ids(1, 5), logits_to_keep=logits_to_keep)


def test_generate_computes_only_the_last_logits_in_both_loops(load):
    """Both loops feed the graph one logits position per row and step, the prompt included (transformers' loop
    through `logits_to_keep=1`, which generate passes to a forward that takes it)."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    session = ort_model.graphs["model"].session
    widths, original = [], session.run

    def recording(output_names, feeds, *args, **kwargs):
        widths.append(int(feeds["logits_positions"].size))
        return original(output_names, feeds, *args, **kwargs)

    session.run = recording
    try:
        input_ids, attention_mask = left_padded_prompts()
        for loop in LOOPS:
            widths.clear()
            expected, actual = generate_both(
                pytorch_model, ort_model, loop, input_ids=input_ids, attention_mask=attention_mask, **GREEDY_FIXED
            )
            assert torch.equal(actual, expected)
            assert widths == [1] * NEW_TOKENS, loop
    finally:
        del session.run


def test_generation_continues_from_a_returned_cache(load):
    """A second generate() over the first one's cache (transformers' loop: the cache is prefilled) ends where one
    uninterrupted generate() ends."""
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    ort_model.fast_generation = True
    greedy = dict(do_sample=False, eos_token_id=None)
    first = ort_model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=3, return_dict_in_generate=True, **greedy
    )
    mask = torch.cat([attention_mask, torch.ones(3, 3, dtype=torch.long)], dim=-1)
    continued = ort_model.generate(
        first.sequences, attention_mask=mask, past_key_values=first.past_key_values, max_new_tokens=3, **greedy
    )
    uninterrupted = ort_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, **greedy)
    assert torch.equal(continued, uninterrupted)


def test_forward_without_cache_returns_no_cache(load):
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    assert ort_model(random_ids(2, 4), use_cache=False).past_key_values is None


def test_text_generation_pipeline_runs_the_onnx_model(load, tokenizer):
    """pipeline("text-generation") accepts the ORT model and writes the PyTorch pipeline's text."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    ort_model.fast_generation = True
    prompt = "Once upon a time, there was"
    expected, actual = (
        pipeline("text-generation", model=model, tokenizer=tokenizer)(prompt, max_new_tokens=6, do_sample=False)
        for model in (pytorch_model, ort_model)
    )
    assert actual == expected


# -------------------------------------------------------------------------------------- seq2seq generation


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_greedy_generation_of_a_padded_source_batch_matches_pytorch(load, loops, name, loop):
    pytorch_model, ort_model = load(OrtModelForSeq2SeqLM, f"seq2seq-{name}")
    input_ids, attention_mask = right_padded_sources()
    expected, actual = generate_both(
        pytorch_model, ort_model, loop, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS
    )
    assert torch.equal(actual, expected)
    assert loops == [loop]


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_beam_search_matches_pytorch(load, name):
    pytorch_model, ort_model = load(OrtModelForSeq2SeqLM, f"seq2seq-{name}")
    input_ids, attention_mask = right_padded_sources()
    expected, actual = generate_both(
        pytorch_model,
        ort_model,
        "transformers",
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        num_beams=4,
        num_return_sequences=2,
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_seeded_sampling_matches_pytorch(load, name, loop):
    pytorch_model, ort_model = load(OrtModelForSeq2SeqLM, f"seq2seq-{name}")
    input_ids, attention_mask = right_padded_sources()
    sampling = dict(do_sample=True, top_p=0.9, num_return_sequences=2, max_new_tokens=NEW_TOKENS)
    expected, actual = generate_both(
        pytorch_model, ort_model, loop, input_ids=input_ids, attention_mask=attention_mask, **sampling
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_graph_emits_the_cross_attention_cache_that_the_decoder_reads(load, name):
    """The encoder graph's cross keys/values equal what PyTorch's decoder caches; forward keeps them, without a copy,
    in the cross-attention half of the cache and decodes to the PyTorch logits."""
    pytorch_model, ort_model = load(OrtModelForSeq2SeqLM, f"seq2seq-{name}")
    input_ids, attention_mask = right_padded_sources()
    decoder_input_ids = random_ids(3, 4, seed=2)
    expected = pytorch_model(
        input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=True
    )
    encoder_outputs = ort_model.get_encoder()(input_ids, attention_mask=attention_mask)
    source = attention_mask.bool()
    assert (encoder_outputs.last_hidden_state - expected.encoder_last_hidden_state)[source].abs().max() < TOLERANCE
    cross_cache = expected.past_key_values.cross_attention_cache
    pytorch_cross = [tensor for layer in cross_cache.layers for tensor in (layer.keys, layer.values)]
    assert len(encoder_outputs.cross_key_values) == len(pytorch_cross)
    for ort_tensor, pytorch_tensor in zip(encoder_outputs.cross_key_values, pytorch_cross):
        assert (ort_tensor - pytorch_tensor).abs().amax(dim=(1, 3))[source].max() < TOLERANCE

    actual = ort_model(
        attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_outputs
    )
    assert (actual.logits - expected.logits).abs().max() < TOLERANCE
    kept = actual.past_key_values.cross_attention_cache.layers[0].keys
    assert kept.data_ptr() == encoder_outputs.cross_key_values[0].data_ptr()
    assert all(actual.past_key_values.is_updated.values())
    # A step through the cache reads the cached cross keys/values, not the (here deliberately absent) encoder output.
    next_ids = expected.logits[:, -1].argmax(-1, keepdim=True)
    expected = pytorch_model(
        attention_mask=attention_mask,
        decoder_input_ids=next_ids,
        encoder_outputs=(expected.encoder_last_hidden_state,),
        past_key_values=expected.past_key_values,
    )
    actual = ort_model(
        attention_mask=attention_mask,
        decoder_input_ids=next_ids,
        encoder_outputs=BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state),
        past_key_values=actual.past_key_values,
    )
    assert (actual.logits - expected.logits).abs().max() < TOLERANCE


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_decoder_repeats_the_cross_keys_values_for_each_beam(load, name):
    """generate repeats each source row of `encoder_outputs` for beams and returned sequences, but only its tensors:
    the decoder repeats the cross-attention keys/values tuple itself, row by row, and refuses a batch it does not
    divide into."""
    pytorch_model, ort_model = load(OrtModelForSeq2SeqLM, f"seq2seq-{name}")
    input_ids, attention_mask = right_padded_sources()
    encoder_outputs = ort_model.get_encoder()(input_ids, attention_mask=attention_mask)
    decoder_input_ids = random_ids(6, 3, seed=2)
    repeated_mask = attention_mask.repeat_interleave(2, dim=0)
    expected = pytorch_model(
        input_ids.repeat_interleave(2, dim=0), attention_mask=repeated_mask, decoder_input_ids=decoder_input_ids
    )
    actual = ort_model(
        attention_mask=repeated_mask, decoder_input_ids=decoder_input_ids, encoder_outputs=encoder_outputs
    )
    assert (actual.logits - expected.logits).abs().max() < TOLERANCE
    with pytest.raises(ValueError, match="not a multiple of the encoder output's"):
        ort_model(decoder_input_ids=random_ids(4, 3), encoder_outputs=encoder_outputs)
    for strategy in (dict(num_beams=3, num_return_sequences=3), dict(do_sample=True, num_return_sequences=3)):
        expected, actual = generate_both(
            pytorch_model,
            ort_model,
            "lean",
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            **strategy,
        )
        assert torch.equal(actual, expected), strategy


# ------------------------------------------------------------- the lean loop, through transformers' public API

LEAN_CASES = [
    pytest.param(OrtModelForCausalLM, "decoder-rope-gqa", left_padded_prompts, id="decoder"),
    pytest.param(OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa", right_padded_sources, id="seq2seq"),
]
STRATEGIES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, num_return_sequences=2),
}


@pytest.mark.parametrize("step", ["lean", "lean via forward"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("ort_class, name, prompts", LEAN_CASES)
def test_greedy_search_and_sampling_run_in_the_lean_loop_through_custom_generate(
    load, loops, monkeypatch, ort_class, name, prompts, strategy, step
):
    """generate prepares the inputs and calls `lean_sample` through its public `custom_generate` hook, which
    decodes without a single call of forward; the tokens are PyTorch's, under the same seed. When the lean step
    cannot take the inputs (`fast_loop_inputs` returns None; forced here), `lean_sample` decodes through forward and
    its cache, as transformers' loop would: PyTorch's tokens too."""
    pytorch_model, ort_model = load(ort_class, name)
    if step == "lean via forward":
        monkeypatch.setattr(ort_model, "fast_loop_inputs", lambda *args: None)
    input_ids, attention_mask = prompts()
    expected, actual = generate_both(
        pytorch_model,
        ort_model,
        "lean",
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        **STRATEGIES[strategy],
    )
    assert torch.equal(actual, expected)
    assert loops == [step]


@pytest.mark.parametrize(
    "options",
    [
        dict(return_dict_in_generate=True),
        dict(streamer="streamer"),
        dict(use_cache=False),
        dict(prefill_chunk_size=4),
        dict(num_beams=2),
        dict(penalty_alpha=0.6, top_k=4),
        dict(custom_generate="own"),
    ],
    ids=lambda options: next(iter(options)),
)
def test_calls_the_lean_loop_does_not_cover_keep_transformers_loop(options):
    """Decided before generate runs, from the effective GenerationConfig and the call's arguments (public API)."""
    config = GenerationConfig(max_new_tokens=4)
    assert lean_steps.lean_loop_fits(config, None, {"input_ids": random_ids(1, 3)})
    assert not lean_steps.lean_loop_fits(config, None, {"input_ids": random_ids(1, 3), **options})
    # A generation_config given to the call counts, completed from the model's own as transformers completes it.
    assert not lean_steps.lean_loop_fits(GenerationConfig(num_beams=2), GenerationConfig(max_new_tokens=4), {})
    assert lean_steps.lean_loop_fits(GenerationConfig(num_beams=2), GenerationConfig(num_beams=1), {})


def test_a_cache_passed_to_generate_keeps_transformers_loop(load, loops):
    """The caller may read or continue a cache they pass: transformers' loop fills it."""
    _, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    ort_model.fast_generation = True
    input_ids, attention_mask = left_padded_prompts()
    cache = DynamicCache()
    ort_model.generate(input_ids, attention_mask=attention_mask, **cache_keyword(cache), **GREEDY_FIXED)
    assert loops == ["transformers"]
    assert cache.get_seq_length() == input_ids.shape[1] + NEW_TOKENS - 1


@pytest.fixture(scope="module")
def gqa_models(tmp_path_factory):
    """A decoder and its export in the GroupQueryAttention form, whose lean loop has a graph of its own."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(**GQA_DECODER))
    folder = tmp_path_factory.mktemp("gqa")
    export_onnx(model, folder, task="text-generation", attention="gqa", validate=False)
    options = default_session_options(num_threads=1)
    return model, OrtModelForCausalLM.from_pretrained(folder, session_options=options)


def test_a_prompt_the_gqa_loop_cannot_start_from_is_decoded_through_forward(gqa_models, loops):
    """A right-padded prompt cannot start the GroupQueryAttention form's own loop (`gqa_sample`): `lean_sample`
    decodes it through forward, with the tokens of transformers' loop; forward refuses the positions it cannot
    rotate by, in both loops. Row 1's single token is followed by padding, so its positions still are the mask's."""
    model, ort_model = gqa_models
    assert ort_model.manifest["attention_form"] == "gqa"
    mask = padding_mask([7, 1], 7, "right")
    prompt = dict(input_ids=random_ids(2, 7) * mask, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)
    for strategy in STRATEGIES.values():
        lean, expected = (generate_both(model, ort_model, loop, **prompt, **strategy)[1] for loop in LOOPS)
        assert torch.equal(lean, expected), strategy
    assert loops == ["lean via forward", "transformers"] * 2
    # Row 0 never reads padding, so its tokens are PyTorch's too (row 1 reads its first new token's logits at a
    # padding column, which PyTorch computes and the GroupQueryAttention form leaves at zero).
    expected, actual = generate_both(model, ort_model, "lean", **prompt, do_sample=False)
    assert torch.equal(actual[0], expected[0])
    mask = padding_mask([7, 4], 7, "right")
    for loop in LOOPS:
        ort_model.fast_generation = loop == "lean"
        with pytest.raises(ValueError, match="takes positions from attention_mask"):
            ort_model.generate(random_ids(2, 7) * mask, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD)


def test_a_padded_decoder_attention_mask_gets_forwards_reason_in_both_loops(load):
    """The decoder graph has no decoder_attention_mask input: the lean step declines a padded one, and forward says
    why, as it does in transformers' loop."""
    _, ort_model = load(OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa")
    input_ids, attention_mask = right_padded_sources()
    decoder_input_ids = torch.full((3, 2), 2)
    decoder_attention_mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    for loop in LOOPS:
        ort_model.fast_generation = loop == "lean"
        with pytest.raises(ValueError, match="has no decoder_attention_mask input"):
            ort_model.generate(
                input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask,
                max_new_tokens=3,
            )


@pytest.mark.parametrize("loop", LOOPS)
def test_without_a_pad_token_finished_rows_are_padded_with_the_end_of_sequence_token(load, loops, loop):
    """pad_token_id unset: finished rows get the first end-of-sequence id, as in transformers."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    prompt = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS)
    free_run, _ = generate_both(pytorch_model, ort_model, loop, **prompt, eos_token_id=None)
    eos = int(free_run[0, input_ids.shape[1] + 1])  # row 0's second new token ends it
    expected, actual = generate_both(pytorch_model, ort_model, loop, **prompt, eos_token_id=[eos, 2], pad_token_id=None)
    assert torch.equal(actual, expected)
    assert (expected[0, input_ids.shape[1] + 2 :] == eos).all()
    assert loops == [loop] * 2


def test_no_private_generation_method_is_overridden_or_read():
    """transformers may move its private names: the ORT models use its public API only (`custom_generate`, the
    public GenerationConfig fields), not `_sample`, `_expand_inputs_for_generation` or `_pad_token_tensor`."""
    for ort_class in (OrtModelForGeneration, OrtModelForCausalLM, OrtModelForSeq2SeqLM):
        assert not {"_sample", "_expand_inputs_for_generation", "_prepare_special_tokens"} & set(vars(ort_class))
    runtimes = (decoders, portable_decoder_runtime, gqa_decoder_runtime, openvino_decoder_runtime)
    for module in (generation, gqa_runtime, held_cache, lean_steps, *runtimes):
        source = inspect.getsource(module)
        for private in ("_pad_token_tensor", "_sample", "_expand_inputs_for_generation", "_prepare_special_tokens"):
            assert not re.search(rf"\b{private}\b", source), (module.__name__, private)
        assert "GenerationMixin._" not in source


# ----------------------------------------------------------------------------------- IO binding (on the CPU)


def test_io_binding_writes_the_cache_into_preallocated_buffers(load):
    """The CUDA path, exercised on the CPU: each step's cache lands in one of two preallocated buffers (the one not
    holding the past), and results equal the unbound session's."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-rope-gqa", use_io_binding=True)
    _, unbound = load(OrtModelForCausalLM, "decoder-rope-gqa")
    input_ids, attention_mask = left_padded_prompts()
    output = ort_model(input_ids, attention_mask=attention_mask)
    reference = unbound(input_ids, attention_mask=attention_mask)
    # Logits live in memory ONNX Runtime allocated and torch shares (DLPack): it must outlive the session's output.
    first_logits, first_logits_copy = output.logits, output.logits.clone()
    buffers = ort_model.kv_buffers[output.past_key_values]
    storages = [buffer.untyped_storage().data_ptr() for buffer in buffers.buffers]
    sides = []
    for _ in range(3):
        assert torch.equal(output.logits, reference.logits)
        keys = [layer.keys for layer in output.past_key_values.layers]
        assert len({key.untyped_storage().data_ptr() for key in keys}) == 1
        sides.append(storages.index(keys[0].untyped_storage().data_ptr()))
        next_ids = reference.logits[:, -1].argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_ids)], dim=-1)
        output = ort_model(next_ids, attention_mask=attention_mask, past_key_values=output.past_key_values)
        reference = unbound(next_ids, attention_mask=attention_mask, past_key_values=reference.past_key_values)
    assert sides == [0, 1, 0]
    assert torch.equal(first_logits, first_logits_copy)


@pytest.mark.parametrize("loop", LOOPS)
def test_io_binding_generation_matches_pytorch(load, loop):
    for ort_class, name, prompts in (
        (OrtModelForCausalLM, "decoder-rope-gqa", left_padded_prompts),
        (OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa", right_padded_sources),
    ):
        pytorch_model, ort_model = load(ort_class, name, use_io_binding=True)
        input_ids, attention_mask = prompts()
        for strategy in (dict(), dict(num_beams=3)):
            expected, actual = generate_both(
                pytorch_model,
                ort_model,
                loop,
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=NEW_TOKENS,
                **strategy,
            )
            assert torch.equal(actual, expected), (name, strategy)


# --------------------------------------------------------------------------------------------- CUDA, fp16


@pytest.mark.parametrize("use_io_binding", [False, True], ids=["session-run", "io-binding"])
def test_fp16_export_keeps_a_half_precision_cache_and_float32_logits(load, use_io_binding):
    """On the CPU provider: the cache is allocated, bound and fed back in the manifest's float16, logits come out in
    float32, and the tokens match PyTorch's (fp32) for this well-separated tiny model."""
    pytorch_model, ort_model = load(OrtModelForCausalLM, "decoder-fp16", use_io_binding=use_io_binding)
    assert ort_model.dtype == torch.float16
    input_ids, attention_mask = left_padded_prompts()
    output = ort_model(input_ids, attention_mask=attention_mask)
    assert output.logits.dtype == torch.float32
    assert {layer.keys.dtype for layer in output.past_key_values.layers} == {torch.float16}
    expected = pytorch_model(input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask))
    real = attention_mask.bool()
    assert (output.logits - expected.logits)[real].abs().max() < 2e-2
    for loop in LOOPS:
        for strategy in (dict(), dict(num_beams=3)):
            expected, actual = generate_both(
                pytorch_model,
                ort_model,
                loop,
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=NEW_TOKENS,
                **strategy,
            )
            assert torch.equal(actual, expected), (loop, strategy)


@needs_cuda
@pytest.mark.parametrize(
    "ort_class, name, prompts",
    [
        (OrtModelForCausalLM, "decoder-rope-gqa", left_padded_prompts),
        (OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa", right_padded_sources),
    ],
)
def test_cuda_generation_matches_pytorch_and_keeps_the_cache_on_the_gpu(load, ort_class, name, prompts):
    pytorch_model, ort_model = load(ort_class, name, provider="cuda")
    input_ids, attention_mask = prompts()
    for loop in LOOPS:
        for strategy in (dict(), dict(num_beams=3)):
            expected, actual = generate_both(
                pytorch_model,
                ort_model,
                loop,
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=NEW_TOKENS,
                **strategy,
            )
            assert torch.equal(actual.cpu(), expected), (loop, strategy)
    output = ort_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **({"decoder_input_ids": random_ids(3, 2)} if ort_class is OrtModelForSeq2SeqLM else {}),
    )
    cache = getattr(output.past_key_values, "self_attention_cache", output.past_key_values)
    assert cache.layers[0].keys.is_cuda and output.logits.is_cuda


@needs_cuda
def test_fp16_cuda_export_generates_like_pytorch_in_half_precision(tmp_path):
    config = tiny_decoder_config(**DECODERS["rope-gqa"])
    export_onnx(build_model(VaswaniForCausalLM, config), tmp_path, task="text-generation", dtype="fp16", device="cuda")
    ort_model = OrtModelForCausalLM.from_pretrained(tmp_path, provider="cuda")
    assert ort_model.dtype == torch.float16
    half = build_model(VaswaniForCausalLM, config).to("cuda", torch.float16)  # the same seeded weights
    input_ids, attention_mask = (tensor.cuda() for tensor in left_padded_prompts())
    positions = positions_from_mask(attention_mask)
    expected = half(input_ids, attention_mask=attention_mask, position_ids=positions).logits.float()
    actual = ort_model(input_ids, attention_mask=attention_mask)
    assert actual.logits.dtype == torch.float32 and actual.past_key_values.layers[0].keys.dtype == torch.float16
    assert actual.past_key_values.layers[0].keys.is_cuda
    assert (actual.logits - expected)[attention_mask.bool()].abs().max() < 2e-2
    expected, actual = generate_both(
        half, ort_model, "lean", input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS
    )
    assert torch.equal(actual, expected)
