"""The ONNX Runtime-only decoder of encoder-decoder exports (`quantize`, `optimize`): its attention runs as contrib
`MultiHeadAttention` with the causal and source-padding masks inside, and it still computes what PyTorch and
transformers' BART compute. The portable export keeps the standard opset-23 `Attention`."""

import collections

import onnx
import pytest
import torch
from conftest import padding_mask, random_ids, tiny_seq2seq_config
from transformers import BartConfig, BartForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from vaswani import VaswaniForConditionalGeneration
from vaswani.conversion.checkpoints import from_transformers
from vaswani.export import export_onnx, trace_onnx
from vaswani.runtime import OrtModelForSeq2SeqLM

VOCAB, LAYERS, PAD = 64, 2, 1
EXPORTS = {"portable": {}, "optimize": {"optimize": True}, "int8": {"quantize": "int8"}}


def tiny_bart() -> BartForConditionalGeneration:
    """BART as the reference benchmark shapes it (post-LN, GELU, learned positions, biases), tiny."""
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        scale_embedding=False, init_std=0.2, pad_token_id=PAD, forced_eos_token_id=None,
    )  # fmt: skip
    return BartForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def bart():
    return tiny_bart()


@pytest.fixture(scope="module")
def exported(bart, tmp_path_factory):
    """Each export form of the converted BART from one trace, validated against PyTorch by the export itself."""
    model = from_transformers(bart)
    root = tmp_path_factory.mktemp("decoder-attention")
    with trace_onnx(model, task="text2text-generation") as traced:  # one trace, every form
        return model, {form: traced.export(root / form, **options).folder for form, options in EXPORTS.items()}


def decoder_ops(folder) -> collections.Counter:
    graph = onnx.load(str(folder / "decoder_model.onnx"), load_external_data=False).graph
    return collections.Counter((node.domain or "ai.onnx", node.op_type) for node in graph.node)


def padded_source(batch: int = 3, length: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    mask = padding_mask([9, 5, 3][:batch], length, "right")
    ids = random_ids(batch, length, VOCAB, seed=1).masked_fill(mask == 0, PAD)
    return ids, mask


@pytest.mark.slow  # three exports of BART (34 s of the default run); make test-slow and CI run it
def test_only_the_onnx_runtime_forms_run_multi_head_attention(exported):
    _, folders = exported
    portable = decoder_ops(folders["portable"])
    assert portable[("ai.onnx", "Attention")] == 2 * LAYERS
    assert not [op for op in portable if op[0] == "com.microsoft"]
    for form in ("optimize", "int8"):
        ops = decoder_ops(folders[form])
        assert ops[("com.microsoft", "MultiHeadAttention")] == 2 * LAYERS, form
        assert ops[("ai.onnx", "Attention")] == 0, form
        # The per-step mask arithmetic and the reshapes around each cross-attention are gone.
        assert sum(ops.values()) < sum(portable.values()) - 20, form


@pytest.mark.parametrize("form", ["optimize", "int8"])
@pytest.mark.slow  # three exports of BART (34 s of the default run); make test-slow and CI run it
def test_cached_steps_match_one_uncached_call_and_pytorch(exported, form):
    model, folders = exported
    ort_model = OrtModelForSeq2SeqLM.from_pretrained(folders[form])
    source, source_mask = padded_source()
    targets = random_ids(3, 6, VOCAB, seed=2)
    whole = ort_model(input_ids=source, attention_mask=source_mask, decoder_input_ids=targets, use_cache=False).logits
    with torch.no_grad():
        expected = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=targets).logits
    # fp32: summation order only; int8: the weights' rounding (a broken mask moves logits by their whole scale).
    tolerance = 1e-4 if form == "optimize" else 0.1 * expected.abs().max().item()
    torch.testing.assert_close(whole, expected, atol=tolerance, rtol=0)

    cache, start = EncoderDecoderCache(DynamicCache(), DynamicCache()), 0
    for length in (3, 2, 1):  # several new tokens after a past: the causal mask offset by the past length
        step = ort_model(
            input_ids=source,
            attention_mask=source_mask,
            decoder_input_ids=targets[:, start : start + length],
            past_key_values=cache,
        )
        torch.testing.assert_close(step.logits, whole[:, start : start + length], atol=1e-4, rtol=0)
        cache, start = step.past_key_values, start + length


@pytest.mark.parametrize("lean_loop", [True, False])
@pytest.mark.slow  # three exports of BART (34 s of the default run); make test-slow and CI run it
def test_greedy_tokens_match_transformers_bart(bart, exported, lean_loop):
    _, folders = exported
    ort_model = OrtModelForSeq2SeqLM.from_pretrained(folders["optimize"])
    ort_model.fast_generation = lean_loop
    source, source_mask = padded_source()
    settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1)
    with torch.no_grad():
        expected = bart.generate(source, attention_mask=source_mask, **settings)
    actual = ort_model.generate(source, attention_mask=source_mask, **settings)
    assert len(set(expected[:, 1:].flatten().tolist())) > 3  # the comparison is over a varied output
    assert actual.tolist() == expected.tolist()


def test_a_biased_self_attention_mask_keeps_the_standard_op(tmp_path):
    # T5-style relative position bias rides in the self-attention mask: MultiHeadAttention's own causal masking
    # would drop it, so only the (unbiased) cross-attention becomes MultiHeadAttention; validation would catch a loss.
    torch.manual_seed(0)
    config = tiny_seq2seq_config(position_embedding_type="relative_bias", num_key_value_heads=4)
    model = VaswaniForConditionalGeneration(config).eval()
    folder = export_onnx(model, tmp_path / "t5", task="text2text-generation", optimize=True).folder
    ops = decoder_ops(folder)
    layers = config.num_hidden_layers
    assert ops[("ai.onnx", "Attention")] == layers
    assert ops[("com.microsoft", "MultiHeadAttention")] == layers


def test_session_options_let_idle_threads_sleep_only_when_asked():
    from vaswani.runtime import default_session_options

    sleeping = default_session_options(2, spinning=False)
    assert sleeping.intra_op_num_threads == 2
    assert sleeping.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception, match="allow_spinning"):  # not set: ONNX Runtime's default, spinning
        default_session_options(2).get_session_config_entry("session.intra_op.allow_spinning")
