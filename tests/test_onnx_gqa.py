"""The ONNX Runtime-only decoder form (`vaswani/export/gqa_rewrite.py`): each layer's rotary + attention as one
GroupQueryAttention node over an in-place KV buffer. It must compute what PyTorch computes (logits of a padded prompt
and of cached steps, greedy tokens of padded batches) and what the portable graph computes (quantized logits,
sampled tokens), and a model it does not fit must keep the portable graph and say why.
"""

import onnx
import pytest
import torch
from conftest import build_causal_lm, max_diff_where, padding_mask, random_ids, tiny_decoder_config

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from onnx_cases import GQA_DECODER  # noqa: E402

from vaswani.export import export_onnx, trace_onnx  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402
from vaswani.runtime.contract import positions_from_mask  # noqa: E402

LENGTHS = [7, 4]  # a left-padded batch of two prompts of different lengths


@pytest.fixture(scope="module")
def model():
    return build_causal_lm(tiny_decoder_config(**GQA_DECODER))


@pytest.fixture(scope="module")
def folders(model, tmp_path_factory):
    """Each form exported once, all from one trace: GQA fp32 and int8 validated against PyTorch by the export itself,
    the portable twins (their oracle for quantized logits and for sampling) without validation."""
    root = tmp_path_factory.mktemp("gqa")
    options = {
        "gqa-fp32": {"attention": "gqa"},
        "gqa-int8": {"quantize": "int8"},  # the default for quantized exports
        "portable-fp32": {"validate": False},
        "portable-int8": {"quantize": "int8", "attention": "portable", "validate": False},
    }
    with trace_onnx(model, task="text-generation") as traced:
        results = {name: traced.export(root / name, **kw) for name, kw in options.items()}
    return {name: result.folder for name, result in results.items()}


def load(folders, name: str) -> OrtModelForCausalLM:
    return OrtModelForCausalLM.from_pretrained(folders[name])


def attention_ops(folder) -> list[str]:
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return [
        node.op_type for node in graph.node if node.op_type in ("GroupQueryAttention", "Attention", "RotaryEmbedding")
    ]


@pytest.mark.parametrize("name", ["gqa-fp32", "gqa-int8"])
def test_export_rewrites_each_layer_into_one_group_query_attention(folders, model, name):
    manifest = load(folders, name).manifest
    assert manifest["attention_form"] == "gqa"
    assert manifest["validation"]["passed"]  # validated on the rewritten graph
    assert attention_ops(folders[name]) == ["GroupQueryAttention"] * model.config.num_hidden_layers
    inputs = [spec["name"] for spec in manifest["graphs"]["model"]["inputs"]]
    assert "attention_mask" not in inputs and "position_ids" not in inputs
    assert {"seqlens_k", "total_sequence_length", "query_seqlens"} <= set(inputs)


def test_plain_fp32_export_stays_portable(folders):
    assert load(folders, "portable-fp32").manifest["attention_form"] == "portable"
    assert "GroupQueryAttention" not in attention_ops(folders["portable-fp32"])


def test_logits_match_pytorch_on_a_padded_prompt_and_cached_steps(folders, model):
    ort_model = load(folders, "gqa-fp32")
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    ort_cache = torch_cache = None
    for step, length in enumerate((7, 3, 1)):
        if step:
            ids = random_ids(2, length, seed=step)
            mask = torch.cat([mask, torch.ones(2, length, dtype=torch.long)], 1)
        positions = positions_from_mask(mask)[:, -length:]
        actual = ort_model(ids, attention_mask=mask, past_key_values=ort_cache)
        with torch.no_grad():
            expected = model(ids, attention_mask=mask, position_ids=positions, past_key_values=torch_cache)
        ort_cache, torch_cache = actual.past_key_values, expected.past_key_values
        assert max_diff_where(mask[:, -length:], actual.logits, expected.logits) < 1e-4, f"step {step}"
        keys, expected_keys = ort_cache.layers[-1].keys, torch_cache.layers[-1].keys
        assert max_diff_where(mask, keys.transpose(1, 2), expected_keys.transpose(1, 2)) < 1e-4, f"cache, step {step}"


def test_int8_logits_match_the_portable_int8_graph(folders):
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    gqa = load(folders, "gqa-int8")(ids, attention_mask=mask).logits
    portable = load(folders, "portable-int8")(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    scale = float(portable.abs().max())
    assert max_diff_where(mask, gqa, portable) < 1e-3 * scale


@pytest.mark.parametrize("lengths", [[6], LENGTHS], ids=["batch 1", "left-padded batch 2"])
@pytest.mark.parametrize("loop", ["lean", "transformers"])
def test_greedy_tokens_match_pytorch_generate(folders, model, lengths, loop, monkeypatch):
    ort_model = load(folders, "gqa-fp32")
    ort_model.fast_generation = loop == "lean"
    if loop == "lean":  # the lean loop drives the graph itself: transformers' per-step forward must not run
        monkeypatch.setattr(ort_model, "forward", lambda *args, **kwargs: pytest.fail("forward ran"))
    mask = padding_mask(lengths, max(lengths), "left")
    ids = random_ids(len(lengths), max(lengths)) * mask
    options = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **options)
    assert torch.equal(ort_model.generate(ids, **options), expected)


def numpy_loop_model(folders, monkeypatch) -> tuple[OrtModelForCausalLM, list]:
    """The GQA fp32 export, whose `forward` must not run, and a list that grows by one per call of the numpy loop."""
    from vaswani.runtime import gqa as gqa_runtime

    ort_model = load(folders, "gqa-fp32")
    monkeypatch.setattr(ort_model, "forward", lambda *args, **kwargs: pytest.fail("forward ran"))
    calls = []
    numpy_loop = gqa_runtime._greedy_numpy
    monkeypatch.setattr(gqa_runtime, "_greedy_numpy", lambda *args: calls.append(1) or numpy_loop(*args))
    return ort_model, calls


def test_plain_greedy_search_with_an_early_end_of_sequence_matches_pytorch(folders, model, monkeypatch):
    """Plain greedy search (no logits processor) takes the numpy loop: one row reaches the end-of-sequence token
    early and is padded from then on, as in transformers' loop, the others go on to max_new_tokens."""
    ort_model, calls = numpy_loop_model(folders, monkeypatch)
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    free_run = model.generate(ids, **options, eos_token_id=None)
    eos = int(free_run[1, 7 + 3])  # the second row's fourth new token ends it there (or earlier)
    expected = model.generate(ids, **options, eos_token_id=eos)
    assert (expected[1, 7 + 4 :] == 0).all()  # the oracle did stop that row early
    assert torch.equal(ort_model.generate(ids, **options, eos_token_id=eos), expected)
    assert torch.equal(ort_model.generate(ids, **options, eos_token_id=None), free_run)
    assert len(calls) == 2


def test_greedy_search_with_min_new_tokens_takes_the_numpy_loop_and_matches_pytorch(folders, model, monkeypatch):
    """min_new_tokens (what a benchmark or an exact-length request sets) holds the end-of-sequence token back: the
    numpy loop writes its -inf itself, and the tokens are transformers'."""
    ort_model, calls = numpy_loop_model(folders, monkeypatch)
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    options = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    eos = int(model.generate(ids, **options, eos_token_id=None)[1, 7 + 1])  # the second row's second new token
    unconstrained = model.generate(ids, **options, eos_token_id=eos)
    expected = model.generate(ids, **options, eos_token_id=eos, min_new_tokens=6)
    assert not torch.equal(expected[:, : unconstrained.shape[1]], unconstrained)  # the constraint changed tokens
    assert torch.equal(ort_model.generate(ids, **options, eos_token_id=eos, min_new_tokens=6), expected)
    assert torch.equal(ort_model.generate(ids, **options, eos_token_id=eos, min_length=7 + 6), expected)
    assert len(calls) == 2


def test_beam_search_through_forward_matches_pytorch(folders, model):
    # Beam search is transformers' own loop: forward with the cache in transformers' layout, reordered per beam.
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    options = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(load(folders, "gqa-fp32").generate(ids, **options), model.generate(ids, **options))


@pytest.mark.parametrize("lengths", [[6], LENGTHS], ids=["batch 1", "left-padded batch 2"])
def test_int8_greedy_tokens_match_the_portable_int8_graph(folders, lengths):
    mask = padding_mask(lengths, max(lengths), "left")
    ids = random_ids(len(lengths), max(lengths)) * mask
    options = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    expected = load(folders, "portable-int8").generate(ids, **options)
    assert torch.equal(load(folders, "gqa-int8").generate(ids, **options), expected)


def test_sampling_with_a_seed_matches_the_portable_graph(folders):
    mask = padding_mask(LENGTHS, 7, "left")
    ids = random_ids(2, 7) * mask
    options = dict(attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20, temperature=1.3, pad_token_id=0)
    runs = {}
    for name in ("gqa-fp32", "portable-fp32"):
        torch.manual_seed(7)
        runs[name] = load(folders, name).generate(ids, **options)
    assert torch.equal(runs["gqa-fp32"], runs["portable-fp32"])


def test_position_ids_other_than_the_masks_are_refused(folders):
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match="takes positions from attention_mask"):
        load(folders, "gqa-fp32")(ids, position_ids=torch.arange(4)[None] + 5)


def test_a_model_the_kernel_cannot_run_keeps_the_portable_graph(tmp_path):
    # head_dim 8: ONNX Runtime's GroupQueryAttention needs a multiple of 16. An optimized export tries the form
    # ("auto"); asked for by name it is refused (tests/test_choices_logged.py).
    model = build_causal_lm(tiny_decoder_config(**{**GQA_DECODER, "hidden_size": 32, "num_hidden_layers": 1}))
    messages = []
    result = export_onnx(model, tmp_path / "out", task="text-generation", optimize=True, progress=messages.append)
    assert result.manifest["attention_form"] == "portable"
    assert "head_dim=8" in result.manifest["attention_form_note"]
    assert any("Keeping the portable attention graph" in message and "head_dim=8" in message for message in messages)
    assert "GroupQueryAttention" not in attention_ops(result.folder) and result.validation.passed
    ids = random_ids(1, 5)
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(OrtModelForCausalLM.from_pretrained(result.folder).generate(ids, **options),
                       model.generate(ids, **options))  # fmt: skip


def test_an_unknown_attention_form_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match="attention='fused' is not supported"):
        export_onnx(model, tmp_path / "out", task="text-generation", attention="fused")
