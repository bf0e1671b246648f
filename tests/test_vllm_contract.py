"""The contract vLLM's Transformers modeling backend needs from a model, checked without vLLM.

vLLM builds the *base* model (`AutoModel.from_config`) with `config._attn_implementation = "vllm"`, finds each
attention module by the one `ALL_ATTENTION_FUNCTIONS` call in its `forward` (its `scaling=` and `layer_idx` tell it
the softmax scale and the layer), and runs the model on one flattened batch, `input_ids` (1, tokens) with
`position_ids`, `use_cache=False`, its own kwargs passed through. Its attention function ignores `attention_mask`:
causality comes from the module's `is_causal` (all `False` means an encoder, served for pooling). Tensor parallelism
follows the base model's `tp_plan` (rules matched as regexes), pipeline parallelism its `pp_plan`. A folder
served as remote code needs `auto_map["AutoModel"]` in `config.json`.

Here a stand-in "vllm" attention function (masks ignored, output flattened to (tokens, heads * head_dim) as vLLM's
is) reproduces that flow; the real engine is exercised by benchmarks/vllm_check.py outside CI.
"""

import ast
import copy
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib
import torch
import torch.nn.functional as F
from conftest import build_model, random_ids, tiny_decoder_config, tiny_encoder_config
from torch import nn
from transformers import AttentionInterface, AutoModel, AutoModelForSequenceClassification

from vaswani import (
    VaswaniDecoderModel,
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
)
from vaswani.modeling.layers import VaswaniAttention

SERVABLE = ["rope", "learned", "sinusoidal", "none"]
SCORE_BIAS = ["alibi", "relative_bias"]
FAMILIES = {"decoder": tiny_decoder_config, "encoder": tiny_encoder_config}


@pytest.fixture
def vllm_attention(monkeypatch):
    """Register a stand-in for vLLM's "vllm" attention function; it records the kwargs of every call."""
    calls: list[dict] = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append({"layer_idx": module.layer_idx, "is_causal": module.is_causal, **kwargs})
        output = F.scaled_dot_product_attention(
            query, key, value, is_causal=module.is_causal, scale=kwargs["scaling"], enable_gqa=True
        )
        tokens = query.shape[-2]
        return output.transpose(1, 2).reshape(tokens, -1), None

    monkeypatch.setitem(AttentionInterface._global_mapping, "vllm", attention)
    return calls


def build_as_vllm(config):
    """The base model as vLLM builds it: the backend written into the config, then `AutoModel.from_config`."""
    config = copy.deepcopy(config)
    config._attn_implementation = "vllm"
    return AutoModel.from_config(config).eval()


@pytest.mark.parametrize("position_embedding_type", SERVABLE)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_flow_matches_eager_and_passes_kwargs_to_every_layer(family, position_embedding_type, vllm_attention):
    config = FAMILIES[family](position_embedding_type=position_embedding_type, num_key_value_heads=2)
    reference = build_model(AutoModel._model_mapping[type(config)], config)
    served = build_as_vllm(config)
    served.load_state_dict(reference.state_dict())
    ids = random_ids(1, 9)
    marker = object()
    with torch.no_grad():
        expected = reference(ids).last_hidden_state
        # vLLM's call: one flattened sequence, explicit positions, no cache, its own kwargs.
        actual = served(
            input_ids=ids, position_ids=torch.arange(9)[None], use_cache=False, return_dict=False, vllm_extra=marker
        )[0]
    assert torch.allclose(actual, expected, atol=1e-5)
    assert [call["layer_idx"] for call in vllm_attention] == list(range(config.num_hidden_layers))
    assert all(call["vllm_extra"] is marker for call in vllm_attention)
    assert all(call["is_causal"] is (family == "decoder") for call in vllm_attention)


@pytest.mark.parametrize("family", FAMILIES)
def test_base_models_declare_backend_support_and_attention_causality(family):
    model = build_model(AutoModel._model_mapping[type(FAMILIES[family]())], FAMILIES[family]())
    assert type(model).is_backend_compatible()
    attention = [module for module in model.modules() if isinstance(module, VaswaniAttention)]
    # vLLM serves a text model as an encoder (pooling only) when any attention module has is_causal=False.
    assert attention and all(module.is_causal is (family == "decoder") for module in attention)


def test_attention_dispatches_through_the_interface_exactly_once_with_a_resolvable_scale():
    # vLLM finds the attention call in the source of forward: one call of a name assigned from
    # ALL_ATTENTION_FUNCTIONS, whose `scaling=` names an attribute of the module.
    tree = ast.parse(textwrap.dedent(inspect.getsource(VaswaniAttention.forward)))
    names = {
        node.target.id if isinstance(node, ast.AnnAssign) else node.targets[0].id
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value)
    }
    calls = [
        node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None) in names
    ]
    assert len(calls) == 1
    scaling = {keyword.arg: ast.unparse(keyword.value) for keyword in calls[0].keywords}["scaling"]
    module = VaswaniAttention(tiny_decoder_config(), layer_idx=3, is_causal=True)
    assert scaling == "self.scaling" and module.scaling == module.head_dim**-0.5 and module.layer_idx == 3
    assert "**kwargs" in ast.unparse(calls[0])


def vllm_tp_style(model: nn.Module, name: str) -> str:
    """The style vLLM gives a Linear: the first base-model plan rule that `re.match`es "model.<name>"."""
    rules = {f"model.{rule}": style for rule, style in model.tp_plan.items()}
    return next((style for rule, style in rules.items() if re.match(rule, f"model.{name}")), "replicate")


@pytest.mark.parametrize("position_embedding_type", SERVABLE)
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_plan_shards_every_projection_as_vllm_reads_it(family, position_embedding_type):
    config = FAMILIES[family](position_embedding_type=position_embedding_type)
    model = build_model(AutoModel._model_mapping[type(config)], config)
    styles = {name: vllm_tp_style(model, name) for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for name, style in styles.items():
        projection = name.rsplit(".", 1)[-1]
        if projection in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            assert style == "colwise", name
        elif projection in ("o_proj", "down_proj"):
            assert style == "rowwise", name


@pytest.mark.parametrize(
    "overrides, has_plan",
    [
        (dict(position_embedding_type="rope"), True),
        (dict(position_embedding_type="none"), True),
        (dict(position_embedding_type="learned"), False),
        (dict(position_embedding_type="sinusoidal"), False),
        (dict(position_embedding_type="rope", embedding_scale=True), False),
    ],
)
def test_pp_plan_only_where_later_stages_can_take_hidden_states_as_inputs_embeds(overrides, has_plan):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(**overrides))
    base = model.model
    assert base.supports_pp_plan is has_plan
    if has_plan:
        # vLLM needs exactly one ModuleList in the plan; what comes before it runs on the first stage only.
        assert list(base.pp_plan) == ["embed_tokens", "layers", "norm"]
        assert isinstance(base.layers, nn.ModuleList)
        # The stage boundary: hidden states passed as inputs_embeds come out of the embedding unchanged.
        hidden = torch.randn(1, 5, model.config.hidden_size)
        assert torch.equal(base.embed(None, hidden, torch.arange(5)[None]), hidden)
    assert model.pp_plan["lm_head"] == (["hidden_states"], ["logits"])


@pytest.mark.parametrize(
    "model_class, config, own_entry",
    [
        (VaswaniForCausalLM, tiny_decoder_config(), ("AutoModelForCausalLM", "decoder.VaswaniForCausalLM")),
        (VaswaniEncoderModel, tiny_encoder_config(), ("AutoModel", "encoder.VaswaniEncoderModel")),
        (
            VaswaniEncoderForSequenceClassification,
            tiny_encoder_config(num_labels=3),
            ("AutoModelForSequenceClassification", "heads.VaswaniEncoderForSequenceClassification"),
        ),
    ],
    ids=["causal_lm", "encoder", "encoder_classifier"],
)
def test_saved_auto_map_names_the_base_model_and_ships_its_code(tmp_path, model_class, config, own_entry):
    build_model(model_class, config).save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    base = "decoder.VaswaniDecoderModel" if config.model_type == "vaswani_decoder" else "encoder.VaswaniEncoderModel"
    assert auto_map["AutoModel"] == base
    assert auto_map[own_entry[0]] == own_entry[1]
    for reference in auto_map.values():
        module, class_name = reference.split(".")
        assert f"\nclass {class_name}(" in (tmp_path / f"{module}.py").read_text()


@pytest.mark.parametrize("position_embedding_type", SCORE_BIAS)
@pytest.mark.parametrize("family", FAMILIES)
def test_score_bias_positions_fail_at_build_with_the_servable_types(family, position_embedding_type, vllm_attention):
    config = FAMILIES[family](position_embedding_type=position_embedding_type)
    # On `meta`, as vLLM builds it: the error comes before any weight or token.
    with torch.device("meta"), pytest.raises(ValueError) as error:
        build_as_vllm(config)
    message = str(error.value)
    assert f"position_embedding_type={position_embedding_type!r}" in message and "'vllm'" in message
    assert all(repr(kind) in message for kind in SERVABLE)
    assert vllm_attention == []


@pytest.mark.parametrize("position_embedding_type", SCORE_BIAS)
def test_score_bias_positions_still_build_with_bias_capable_backends(position_embedding_type):
    for backend in ("eager", "sdpa"):
        model = VaswaniDecoderModel._from_config(
            tiny_decoder_config(position_embedding_type=position_embedding_type), attn_implementation=backend
        )
        assert model.config._attn_implementation == backend


def test_classifier_with_berts_pooler_fails_at_build_under_vllm(vllm_attention):
    # vLLM applies the classifier to its own pooled hidden state; a dense + tanh pooler in between would be skipped.
    config = tiny_encoder_config(num_labels=3, add_pooler=True)
    config._attn_implementation = "vllm"
    with torch.device("meta"), pytest.raises(ValueError, match="add_pooler=True"):
        AutoModelForSequenceClassification.from_config(config)
    config.add_pooler = False
    assert AutoModelForSequenceClassification.from_config(config).model.pooler is None


# ---------------------------------------------------------------------- the plugin modules, with vLLM stood in for

VLLM_MODULES = ("vllm", "vllm.model_executor", "vllm.model_executor.models", "vllm.model_executor.models.transformers")


def test_the_plugin_registers_every_served_vaswani_architecture_with_vllm(monkeypatch):
    """`vaswani.vllm_plugin.register`, as vLLM calls it, against a stand-in `vllm` that records the registrations
    (vLLM itself is not installed here). Every architecture it maps is a vaswani model class, and each target is a
    class of vLLM's Transformers backend or of `vaswani.vllm_models` that imports against that backend."""
    import importlib
    import types

    import vaswani

    registered = {}

    class TransformersForSequenceClassification:  # the base vaswani.vllm_models extends
        pass

    stand_ins = {name: types.ModuleType(name) for name in VLLM_MODULES}
    stand_ins["vllm"].ModelRegistry = types.SimpleNamespace(register_model=registered.__setitem__)
    backend = stand_ins["vllm.model_executor.models.transformers"]
    backend.TransformersForSequenceClassification = TransformersForSequenceClassification
    for name, module in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, module)
    # Imported afresh against the stand-in, and forgotten afterwards (monkeypatch restores its absence).
    monkeypatch.setitem(sys.modules, "vaswani.vllm_models", None)
    monkeypatch.delitem(sys.modules, "vaswani.vllm_models")
    plugin = importlib.import_module("vaswani.vllm_plugin")
    plugin.register()
    assert registered == plugin.BACKEND_CLASSES
    assert all(hasattr(vaswani, architecture) for architecture in registered)
    served = {name for name in vaswani.__all__ if name.startswith("Vaswani") and "Config" not in name}
    # Encoder-decoder models are not served by vLLM's Transformers backend; everything else that vLLM can run is.
    assert served - set(registered) <= {
        "VaswaniForConditionalGeneration", "VaswaniSeq2SeqModel", "VaswaniPreTrainedModel", "VaswaniForMaskedLM",
        "VaswaniForTokenClassification", "VaswaniForQuestionAnswering", "VaswaniForSequenceClassification",
    }  # fmt: skip
    for target in registered.values():
        module_name, class_name = target.split(":")
        if module_name.startswith("vaswani."):
            cls = getattr(importlib.import_module(module_name), class_name)
            assert issubclass(cls, TransformersForSequenceClassification)
        else:
            assert module_name == plugin.BACKEND and class_name.startswith("Transformers")
    entry_points = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points["vllm.general_plugins"] == {"vaswani": "vaswani.vllm_plugin:register"}
