"""The quantization registry (`vaswani.quantization`): one `Quantization` object per export, built from a scheme's
defaults and checked when built, its `to_json()` the manifest's `quantization_options` as folders already hold them;
a scheme registered from outside the package (a toy one here) is exported, validated and recorded end to end."""

import argparse

import pytest
import torch
from conftest import build_model, tiny_decoder_config

from vaswani import VaswaniForCausalLM
from vaswani.quantization import (
    OPTIONS,
    SCHEMES,
    Quantization,
    QuantizationScheme,
    QuantizedBounds,
    add_quantization_arguments,
    register_scheme,
    scheme_named,
)

# `quantization_options` of an int4 export at defaults and of an int8 one, as the exports before the registry wrote
# them (less the keys the exporter adds: eight_bit_matmuls, unscored_matmuls, input_weighted).
SAVED_INT4_OPTIONS = {
    "name": "int4-weight-only",
    "bits": 4,
    "symmetric": False,
    "head_bits": 8,
    "block_size": 32,
    "accuracy_level": 4,
    "method": "search",
    "narrowing_bits": None,
    "eight_bit_budget": 0.3,
}
SAVED_INT8_OPTIONS = {**SAVED_INT4_OPTIONS, "name": "int8-weight-only", "bits": 8, "symmetric": True}
SAVED_INT8_OPTIONS.update(method="rtn", eight_bit_budget=0.0)


def test_scheme_defaults_are_the_manifests_options_of_saved_folders():
    assert Quantization.of("int4").to_json() == SAVED_INT4_OPTIONS
    assert Quantization.of("int8").to_json() == SAVED_INT8_OPTIONS
    assert Quantization.of("int4", method="rtn", narrowing_bits=8).to_json() == {
        **SAVED_INT4_OPTIONS,
        "method": "rtn",
        "narrowing_bits": 8,
    }
    assert scheme_named("int8-weight-only") is SCHEMES["int8"] and Quantization.of("int4").scheme is SCHEMES["int4"]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Quantization.of("int3"), "quantize='int3' is not supported; use one of"),
        (lambda: Quantization.of("int8", method="gptq"), "int4_method applies to quantize='int4' only"),
        (lambda: Quantization.of("int4", block_size=7), "block_size=7 is not supported; use one of (16, 32, 64, 128)"),
        (lambda: Quantization.of("int4", eight_bit_budget=1.5), "in [0, 1)"),
        (lambda: Quantization.of("int4", head_bits=2), "int4_head_bits=2 needs quantize='int4' and is 4 or 8"),
        (lambda: Quantization.of("int4", bits=3), "quantize='int4' does not take bits"),
        (lambda: Quantization("int4-weight-only", bits=4, symmetric=False, method="hqq"), "int4_method='hqq'"),
    ],
    ids=["unknown_scheme", "int4_option_to_int8", "block_size", "budget", "head_bits", "not_an_option", "built"],
)
def test_a_bad_quantization_is_refused_when_built(build, message):
    with pytest.raises(ValueError) as refusal:
        build()
    assert message in str(refusal.value)


def test_command_line_flags_build_one_quantization():
    parser = argparse.ArgumentParser()
    add_quantization_arguments(parser)
    args = parser.parse_args(
        ["--quantize", "int4", "--int4-mlp-out-bits", "8", "--int4-symmetric", "--block-size", "64"]
    )
    assert Quantization.from_cli(args) == Quantization.of("int4", narrowing_bits=8, symmetric=True, block_size=64)
    assert Quantization.from_cli(parser.parse_args([])) is None
    with pytest.raises(ValueError, match="apply to quantized exports: pass quantize='int8' or 'int4'"):
        Quantization.from_cli(parser.parse_args(["--int4-head-bits", "4"]))


@pytest.fixture
def toy_scheme():
    """An 8-bit scheme in blocks of 16 with float32 compute, registered under a test name (and removed after)."""
    from vaswani.quantization.matmul_nbits import quantize_graph

    passes = []

    def graph_pass(path, quantization, *calibration):
        passes.append(path.name)
        return quantize_graph(path, quantization, *calibration)

    scheme = QuantizationScheme(
        key="toy8",
        defaults=Quantization("toy-int8-block16", bits=8, symmetric=True, block_size=16, accuracy_level=0),
        options=frozenset({"block_size"}),
        graph_pass=graph_pass,
        logits_bounds=QuantizedBounds(relative_rms=0.1, cosine=0.995, top1=0.9),
        states_bounds=QuantizedBounds(relative_rms=0.2, cosine=0.98),
        rounding_bits=8,
        matmul_bounds={8: 0.04},
        help="a test's 8-bit scheme in blocks of 16",
    )
    register_scheme(scheme)
    yield scheme, passes
    del SCHEMES[scheme.key]


def test_a_registered_scheme_exports_validates_and_is_recorded(toy_scheme, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from vaswani.cli.main import main
    from vaswani.runtime import OrtModelForCausalLM, load_manifest

    scheme, passes = toy_scheme
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=2))
    model.save_pretrained(tmp_path / "model")
    # As a user types it: the CLI's --quantize lists every registered scheme, with the options the scheme declares.
    assert (
        main(["export", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"), "--quantize", "toy8"])
        == 0
    )
    assert passes == ["model.onnx"]
    manifest = load_manifest(tmp_path / "out")
    assert manifest["quantization"] == "toy-int8-block16"
    assert manifest["quantization_options"]["block_size"] == 16
    validation = manifest["validation"]
    assert validation["passed"] and validation["tolerance_kind"] == "quantized" and validation["tolerance"] == 0.1
    assert {row["bound"] for row in validation["matmuls"]} == {0.04}
    nodes = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.node
    nbits = [{a.name: a.i for a in node.attribute} for node in nodes if node.op_type == "MatMulNBits"]
    assert nbits and all(node["bits"] == 8 and node["block_size"] == 16 for node in nbits)
    assert all("accuracy_level" not in node for node in nbits)  # float32 compute, the scheme's default
    # The folder loads and runs like any quantized export.
    loaded = OrtModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape[1] == 5
    # An option the scheme does not declare is refused with its own message.
    code = main(["export", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "o2"), "--quantize", "toy8",
                 "--int4-method", "rtn"])  # fmt: skip
    assert code == 2 and "int4_method applies to quantize='int4' only" in capsys.readouterr().err
    assert set(OPTIONS) >= scheme.options
