"""Attention backends: eager, sdpa and flex_attention compute the same model, whatever the position encoding and
padding; attention probabilities are well formed; custom backends plug in; unsupported combinations fail clearly.

flex_attention compiles its kernel on first use (seconds on a CPU), so its cases are few and run without gradients
(flex has no CPU backward).
"""

import pytest
import torch
from conftest import (
    FLEX_SHAPE,
    POSITION_TYPES,
    TOLERANCE,
    build_causal_lm,
    max_diff_where,
    padding_mask,
    random_ids,
    tiny_decoder_config,
    with_attention_backend,
)
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vaswani.modeling import layers, pretrained

LENGTH = 10


def gqa_model(position_embedding_type: str, attn_implementation: str = "eager", **shape):
    # Grouped-query attention exercises both repeat_kv (eager) and the backends' native GQA paths.
    shape.setdefault("num_key_value_heads", shape.get("num_attention_heads", 4) // 2)
    config = tiny_decoder_config(position_embedding_type=position_embedding_type, **shape)
    return build_causal_lm(config, attn_implementation)


@pytest.fixture
def fresh_dynamo():
    # torch 2.13's CPU inductor can generate broken code when flex_attention recompiles for a new score_mod or shape
    # in a process that already compiled it; start each flex case from a clean compiler state.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("side", ["left", "right"], ids=["left_padding", "right_padding"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_sdpa_matches_eager(position_embedding_type, side):
    eager = gqa_model(position_embedding_type)
    sdpa = with_attention_backend(eager, "sdpa")
    input_ids, mask = random_ids(3, LENGTH), padding_mask([LENGTH, 7, 3], LENGTH, side)
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=mask).logits
        actual = sdpa(input_ids, attention_mask=mask).logits
    assert max_diff_where(mask, actual, expected) <= TOLERANCE


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_flex_attention_matches_eager(position_embedding_type, fresh_dynamo):
    eager = gqa_model(position_embedding_type, **FLEX_SHAPE)
    flex = with_attention_backend(eager, "flex_attention")
    # One batch covers both paddings (one flex compile instead of two): a full, a left- and a right-padded row.
    input_ids = random_ids(3, LENGTH)
    mask = torch.cat([padding_mask([LENGTH, 6], LENGTH, "left"), padding_mask([4], LENGTH, "right")])
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=mask).logits
        actual = flex(input_ids, attention_mask=mask).logits
    assert max_diff_where(mask, actual, expected) <= TOLERANCE


def test_position_bias_changes_logits_far_beyond_the_parity_tolerance():
    """Guard for the parity tests above: the bias matters enough that ignoring it would exceed the tolerance."""
    eager = gqa_model("relative_bias")
    without_bias = gqa_model("none")
    without_bias.load_state_dict(eager.state_dict(), strict=False)
    input_ids = random_ids(2, LENGTH)
    with torch.no_grad():
        difference = (eager(input_ids).logits - without_bias(input_ids).logits).abs().max()
    assert difference > 1000 * TOLERANCE


@pytest.mark.parametrize("side", ["left", "right"], ids=["left_padding", "right_padding"])
def test_eager_attention_probabilities_are_causal_distributions_over_real_keys(side):
    model = gqa_model("alibi")
    input_ids, mask = random_ids(2, LENGTH), padding_mask([LENGTH, 6], LENGTH, side)
    with torch.no_grad():
        attentions = model(input_ids, attention_mask=mask, output_attentions=True).attentions
    assert len(attentions) == model.config.num_hidden_layers
    # Weight a real query must not give: future keys and padding. (A padding query that sees no real key spreads its
    # weight anywhere; its output is never used.)
    forbidden_keys = torch.ones(LENGTH, LENGTH).triu(1).bool() | ~mask.bool()[:, None, None, :]
    real_queries = mask.bool()[:, None, :, None]
    for probs in attentions:
        assert probs.shape == (2, model.config.num_attention_heads, LENGTH, LENGTH)
        sums = probs.sum(-1)  # (batch, heads, queries)
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        assert probs.masked_fill(~(forbidden_keys & real_queries), 0).abs().max() == 0


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa", "flex_attention"])
def test_fully_masked_query_rows_give_no_nan(attn_implementation, fresh_dynamo):
    # Under left padding the first pad position may attend to nothing: a causal mask over pad keys only.
    model = gqa_model("alibi", attn_implementation, **FLEX_SHAPE)
    input_ids, mask = random_ids(2, LENGTH), padding_mask([LENGTH, 4], LENGTH, "left")
    with torch.no_grad():
        logits = model(input_ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()


def test_registered_attention_function_is_called_and_matches_sdpa():
    calls = []

    # A function that receives the position bias declares it: one that only forwards **kwargs is refused for ALiBi
    # and relative bias (see test_transformers_compat), since most such functions drop it.
    def counting_sdpa(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, position_bias=position_bias, **kwargs)

    AttentionInterface.register("counting_sdpa", counting_sdpa)
    # Without a registered mask format transformers hands custom functions no mask at all (padding ignored).
    AttentionMaskInterface.register("counting_sdpa", sdpa_mask)
    sdpa = gqa_model("alibi", "sdpa")
    custom = with_attention_backend(sdpa, "counting_sdpa")
    input_ids, mask = random_ids(2, LENGTH), padding_mask([LENGTH, 6], LENGTH, "left")
    with torch.no_grad():
        expected = sdpa(input_ids, attention_mask=mask).logits
        actual = custom(input_ids, attention_mask=mask).logits
    assert calls == list(range(sdpa.config.num_hidden_layers))
    assert max_diff_where(mask, actual, expected) <= TOLERANCE


@pytest.mark.parametrize("position_embedding_type", ["alibi", "relative_bias"])
def test_a_half_precision_backend_receives_the_bias_in_the_queries_dtype(position_embedding_type):
    """ALiBi's bias is computed in float32; handed to SDPA beside bf16 queries on CUDA it attended wrongly (logits 10
    off on an H200, tests/test_cuda.py), so every backend but eager gets it in the queries' dtype."""
    seen = []

    def recording_sdpa(module, query, key, value, attention_mask, position_bias=None, **kwargs):
        seen.append((query.dtype, position_bias.dtype))
        return sdpa_attention_forward(module, query, key, value, attention_mask, position_bias=position_bias, **kwargs)

    AttentionInterface.register("recording_sdpa", recording_sdpa)
    AttentionMaskInterface.register("recording_sdpa", sdpa_mask)
    model = with_attention_backend(gqa_model(position_embedding_type), "recording_sdpa").to(torch.bfloat16)
    with torch.no_grad():
        model(random_ids(2, LENGTH), attention_mask=padding_mask([LENGTH, 6], LENGTH, "left"))
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("position_embedding_type", ["alibi", "relative_bias"])
def test_flash_attention_refuses_score_bias_positions(position_embedding_type):
    model = gqa_model(position_embedding_type)
    # Set directly: loading with flash_attention_2 would already fail on a machine without the flash-attn package.
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"position_embedding_type='(alibi|relative_bias)'.*'sdpa'"):
        model(random_ids(1, 4))


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
@pytest.mark.parametrize("shape", [{}, FLEX_SHAPE], ids=["8-wide heads", "32-wide heads"])
def test_a_forward_warns_where_torchs_cpu_flex_kernel_computes_wrong_attention(capability, shape, monkeypatch):
    """torch 2.13's CPU flex kernel on AVX2-only CPUs is wrong for narrow heads (conftest's FLEX_SHAPE says where); a
    forward there says so instead of returning its numbers silently."""
    warned, checked = [], []
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(layers.logger, "warning_once", warned.append)
    model = gqa_model("rope", **shape)
    model.config._attn_implementation = "flex_attention"
    layers.warn_if_cpu_flex_attention_is_unreliable(model.config, torch.device("cpu"))
    expected = capability == "AVX2" and model.config.head_dim < 32
    assert len(warned) == expected and all("head_dim=8" in message and "sdpa" in message for message in warned)
    # Every forward checks (here on eager, which needs no compile), with the inputs' device.
    monkeypatch.setattr(pretrained, "warn_if_cpu_flex_attention_is_unreliable", lambda *args: checked.append(args))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        model(random_ids(1, 4))
    assert checked and all(config is model.config and device.type == "cpu" for config, device in checked)
