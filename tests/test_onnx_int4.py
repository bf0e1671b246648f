"""int4 methods (`int4_method`, vaswani/quantization/int4.py): the same graph as round to nearest (RTN), node for
node, with other 4-bit integers. Checked against independent oracles: ONNX Runtime's own quantizer for the
MatMulNBits layout, the float weights for the error of a weight (search) or of a layer's output (gptq), and PyTorch
float32 for the exported model's next-token distributions on held-out text (gptq, calibrated on the same corpus).

The 8-bit budget (`int4_8bit_budget`, vaswani/quantization/sensitivity.py): its Fisher scores against the KL
divergence that rounding each matrix alone adds, measured; the chosen matrices in the graph, within the budget.
"""

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import build_model, tiny_decoder_config

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from vaswani import VaswaniForCausalLM  # noqa: E402
from vaswani.cli.main import main  # noqa: E402
from vaswani.data import corpus_text  # noqa: E402
from vaswani.data.tokenization import corpus_tokenizer  # noqa: E402
from vaswani.export import export_onnx, trace_onnx  # noqa: E402
from vaswani.quantization import DEFAULT_EIGHT_BIT_BUDGET, Quantization, int4, sensitivity  # noqa: E402
from vaswani.quantization.int4 import (  # noqa: E402
    CALIBRATION_TOKENS,
    gptq,
    pack_matmul_nbits,
    rtn_grid,
    search_grid,
    search_quantize,
    unpack_matmul_nbits,
)
from vaswani.quantization.matmul_nbits import import_quantizer  # noqa: E402
from vaswani.quantization.sensitivity import (  # noqa: E402
    fisher_row_scores,
    recorded_input_mean_squares,
    rounding_error,
    row_key,
)
from vaswani.runtime import load_manifest  # noqa: E402

BLOCK = 32
METHODS = ("rtn", "search", "gptq")


def rtn(weight: np.ndarray) -> tuple[np.ndarray, ...]:
    """Round to nearest per block of BLOCK rows, our way: integers, scales and zero points."""
    blocks = torch.tensor(weight, dtype=torch.float64).reshape(-1, BLOCK, weight.shape[1])
    grids = [rtn_grid(block) for block in blocks]
    integers = [torch.clamp(torch.round(block / s + z), 0, 15) for block, (s, z) in zip(blocks, grids)]
    return (
        torch.cat(integers).numpy().astype(np.uint8),
        torch.stack([s for s, _ in grids]).numpy().astype(np.float32),
        torch.stack([z for _, z in grids]).numpy().astype(np.uint8),
    )


def dequantized(integers, scales, zeros) -> np.ndarray:
    return (integers.astype(np.float64) - np.repeat(zeros, BLOCK, 0)) * np.repeat(scales, BLOCK, 0)


@pytest.mark.parametrize("rows", [64, 96])  # an even and an odd number of blocks (zero points pack two a byte)
def test_our_packing_is_onnx_runtimes_matmul_nbits_layout(rows):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    import_quantizer()
    weight = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=False, bits=4)
    theirs = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    ours = pack_matmul_nbits(*rtn(weight), BLOCK)
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6)
    np.testing.assert_array_equal(ours[2], theirs[2])
    np.testing.assert_allclose(unpack_matmul_nbits(*theirs, rows), dequantized(*rtn(weight)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [64, 96])
def test_symmetric_round_to_nearest_is_onnx_runtimes_symmetric_quantizer(rows):
    """The speed-first layout (`int4_symmetric`): no zero points, MatMulNBits assumes 8; ONNX Runtime's quantizer puts
    each block's largest magnitude on -8 with a signed scale. Ours must store the same bytes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    import_quantizer()
    weight = np.random.default_rng(1).standard_normal((rows, 5)).astype(np.float32)
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, bits=4)
    theirs = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    blocks = torch.tensor(weight, dtype=torch.float64).reshape(-1, BLOCK, weight.shape[1])
    scales, zeros = rtn_grid(blocks, symmetric=True)
    integers = torch.clamp(torch.round(blocks / scales[:, None] + zeros[:, None]), 0, 15).reshape(rows, -1)
    assert (zeros == 8).all() and (scales < 0).any() and (scales > 0).any()
    ours = pack_matmul_nbits(
        integers.numpy().astype(np.uint8), scales.numpy().astype(np.float32), zeros.numpy().astype(np.uint8), BLOCK
    )
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-6)


def test_symmetric_search_never_loses_to_symmetric_round_to_nearest_and_keeps_the_zero_point():
    weight = np.random.default_rng(2).standard_t(4, (4 * BLOCK, 16)).astype(np.float32)  # heavy tails, as trained
    integers, scales, zeros = search_quantize(weight, BLOCK, symmetric=True)
    assert (zeros == 8).all() and integers.max() <= 15
    blocks = torch.tensor(weight, dtype=torch.float64).reshape(-1, BLOCK, 16)
    rtn_scales, _ = rtn_grid(blocks, symmetric=True)
    rounded = (torch.clamp(torch.round(blocks / rtn_scales[:, None]) + 8, 0, 15) - 8) * rtn_scales[:, None]

    def block_errors(quantized):
        return np.square(np.asarray(quantized).reshape(4, BLOCK, 16) - weight.reshape(4, BLOCK, 16)).sum(axis=1)

    searched = block_errors(dequantized(integers, scales, zeros))
    assert (searched <= block_errors(rounded) * (1 + 1e-4)).all()
    assert searched.sum() < block_errors(rounded).sum()


def test_a_symmetric_int4_export_stores_no_zero_points_and_validates(tmp_path):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    assert main(["export", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"), "--quantize", "int4",
                 "--int4-symmetric", "--int4-8bit-budget", "0"]) == 0  # fmt: skip
    manifest = load_manifest(tmp_path / "out")
    assert manifest["quantization_options"]["symmetric"] and manifest["validation"]["passed"]
    graph = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    four_bit = [node for node in graph.node if node.op_type == "MatMulNBits" and node.attribute and
                any(a.name == "bits" and a.i == 4 for a in node.attribute)]  # fmt: skip
    # A, B, scales, and no zero points (an empty name where a bias follows)
    assert four_bit and all(len(node.input) == 3 or node.input[3] == "" for node in four_bit)


def lattice_weight_and_inputs(seed: int = 0):
    """A weight whose blocks already sit on a 4-bit grid with a float offset (a checkpoint once stored as Q4_1), and
    correlated inputs with a mean (as after a norm): calibration and held-out samples of the same distribution."""
    rng = np.random.default_rng(seed)
    rows, columns = 4 * BLOCK, 16
    step = rng.uniform(0.01, 0.02, (rows // BLOCK, 1, columns))
    low = -rng.uniform(3, 12, (rows // BLOCK, 1, columns)) * step
    levels = rng.integers(0, 16, (rows // BLOCK, BLOCK, columns))
    weight = (low + step * levels).reshape(rows, columns).astype(np.float32)
    mixing = rng.standard_normal((rows, rows)) * 0.2 + np.eye(rows)
    mean = rng.uniform(-1, 2, rows)

    def inputs(count):
        return rng.standard_normal((count, rows)) @ mixing + mean

    return weight, inputs(4096), inputs(4096)


def test_gptq_beats_round_to_nearest_on_held_out_inputs_of_its_calibration_distribution():
    weight, calibration, held_out = lattice_weight_and_inputs()
    integers, scales, zeros = gptq(weight, calibration.T @ calibration, BLOCK)
    assert integers.max() <= 15 and zeros.max() <= 15 and scales.shape == zeros.shape == (4, 16)
    error = np.linalg.norm(held_out @ (dequantized(integers, scales, zeros) - weight))
    assert error < 0.8 * np.linalg.norm(held_out @ (dequantized(*rtn(weight)) - weight))


def test_search_never_loses_to_round_to_nearest_per_block_and_wins_on_offset_grids():
    weight, _, _ = lattice_weight_and_inputs()
    integers, scales, zeros = search_quantize(weight, BLOCK)
    assert integers.max() <= 15 and zeros.max() <= 15 and scales.shape == zeros.shape == (4, 16)

    def block_errors(quantized):
        return np.square(quantized - weight).reshape(4, BLOCK, 16).sum(axis=1)

    searched, rounded = block_errors(dequantized(integers, scales, zeros)), block_errors(dequantized(*rtn(weight)))
    assert (searched <= rounded * (1 + 1e-4)).all()  # RTN is a candidate (float32 vs float64 rounding aside)
    assert searched.sum() < 0.8 * rounded.sum()


@pytest.mark.parametrize("symmetric", [False, True])
def test_search_in_slices_of_columns_is_the_search_of_the_whole_matrix(monkeypatch, symmetric):
    """The search runs on cache-sized slices of columns; the oracle is `search_grid` on every block of the whole
    matrix at once (rows weighted as the search weighs them), with slices that leave a ragged last one."""
    rng = np.random.default_rng(5)
    weight = rng.standard_t(4, (4 * BLOCK, 37)).astype(np.float32)
    mean_squares = np.exp(rng.normal(0, 1, 4 * BLOCK)).astype(np.float32)
    monkeypatch.setattr(int4, "SEARCH_SLICE_ELEMENTS", 4 * BLOCK * 5)  # slices of 5 columns: 8 of them
    integers, scales, zeros = search_quantize(weight, BLOCK, symmetric=symmetric, input_mean_squares=mean_squares)
    blocks = torch.tensor(weight).reshape(4, BLOCK, 37)
    rms = torch.tensor(mean_squares).sqrt()
    whole_scales, whole_zeros = search_grid(
        blocks, symmetric=symmetric, row_weights=(rms / rms.mean()).clamp(min=0.01).reshape(4, BLOCK, 1)
    )
    whole_integers = torch.clamp(torch.round(blocks / whole_scales[:, None] + whole_zeros[:, None]), 0, 15)
    np.testing.assert_array_equal(scales, whole_scales.numpy())
    np.testing.assert_array_equal(zeros, whole_zeros.to(torch.uint8).numpy())
    np.testing.assert_array_equal(integers, whole_integers.reshape(4 * BLOCK, 37).to(torch.uint8).numpy())


def test_search_weighted_by_input_rms_lowers_the_error_the_outputs_see():
    """Rows read by large inputs count more: against the unweighted search, the output error on inputs of that
    scale is no larger per block and smaller in all."""
    rng = np.random.default_rng(3)
    weight = rng.standard_t(4, (4 * BLOCK, 16)).astype(np.float32)
    mean_squares = np.exp(rng.normal(0, 1.5, 4 * BLOCK)).astype(np.float32)  # a few loud channels, as after a norm
    inputs = rng.standard_normal((2048, 4 * BLOCK)) * np.sqrt(mean_squares)
    weighted = dequantized(*search_quantize(weight, BLOCK, input_mean_squares=mean_squares))
    plain = dequantized(*search_quantize(weight, BLOCK))

    def output_error(quantized):
        return np.linalg.norm(inputs @ (quantized - weight))

    assert output_error(weighted) < 0.95 * output_error(plain)


def test_recorded_input_mean_squares_are_each_projections_normed_input():
    """The oracle: the hidden states transformers returns, through the layer's own input norm, are what q/k/v read."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=2)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad(), recorded_input_mean_squares(model) as mean_squares:
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    for index, layer in enumerate(model.model.layers):
        with torch.no_grad():
            normed = layer.self_attn_norm(hidden[index]).reshape(-1, model.config.hidden_size)
        expected = normed.double().square().mean(0).float().numpy()
        for projection in (layer.self_attn.q_proj, layer.self_attn.v_proj):
            row = projection.weight.detach().float().numpy()[0]
            np.testing.assert_allclose(mean_squares[row_key(row)], expected, rtol=1e-4)


# ------------------------------------------------------------------------------------ exported models


def windows(text: str, tokenizer, length: int = 48, count: int = 8) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: length * count]
    return torch.tensor(ids).reshape(count, length)


def train_on_corpus(model, data: torch.Tensor, steps: int) -> None:
    """A few AdamW steps of next-token training on `data` [64, length] in batches of 8; the model ends in eval mode."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = data[(step * 8) % 64 : (step * 8) % 64 + 8]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny causal LM trained for a few steps on the corpus (trained weights have the outlier inputs and the
    structure that separate quantizers; random ones do not), saved with its tokenizer, and its int4 exports."""
    folder = tmp_path_factory.mktemp("int4") / "model"
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(vocab_size=len(tokenizer), initializer_range=0.02))
    train_on_corpus(model, windows(corpus_text()[200_000:260_000], tokenizer, length=64, count=64), steps=60)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with trace_onnx(folder, "text-generation") as traced:  # one trace, each int4 form derived from it
        exports = {method: traced.export(folder.parent / method, quantize=Quantization.of("int4", method=method))
                   for method in METHODS}  # fmt: skip
        exports["search, mlp out 8-bit"] = traced.export(
            folder.parent / "mlp8", quantize=Quantization.of("int4", narrowing_bits=8, eight_bit_budget=0)
        )
        for budget in (0.0, BUDGET):
            exports[f"budget {budget}"] = traced.export(
                folder.parent / f"budget{budget}", quantize=Quantization.of("int4", eight_bit_budget=budget)
            )
    return model, tokenizer, exports


# A budget other than the default that buys a few of the tiny model's matrices (each is 5-20% of the bytes).
BUDGET = 0.15


@pytest.mark.slow  # a trained model and six int4 exports (29 s); make test-slow and CI run it
def test_every_int4_method_is_rtns_graph_with_other_integers(trained):
    _, _, exports = trained

    def graph(method):
        return onnx.load(str(exports[method].folder / "model.onnx"), load_external_data=True).graph

    def nbits_attributes(graph):
        return [
            {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            for node in graph.node
            if node.op_type == "MatMulNBits"
        ]

    def weights(graph):
        quantized = {node.input[1] for node in graph.node if node.op_type == "MatMulNBits"}
        return {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer if t.name in quantized}

    reference = graph("rtn")
    for method in ("search", "gptq"):
        other = graph(method)
        assert Counter(node.op_type for node in other.node) == Counter(node.op_type for node in reference.node)
        assert nbits_attributes(other) == nbits_attributes(reference)
        assert {a["bits"] for a in nbits_attributes(other)} == {4, 8}  # body 4-bit, LM head 8-bit
        ours, theirs = weights(other), weights(reference)
        changed = [name for name in theirs if not np.array_equal(ours[name], theirs[name])]
        assert changed, f"{method} chose exactly RTN's integers everywhere"
        manifest = load_manifest(exports[method].folder)
        assert manifest["quantization_options"]["method"] == method
        assert manifest["validation"]["passed"]  # within the int4 tolerance of PyTorch, as RTN


@pytest.mark.slow  # a trained model and six int4 exports (29 s); make test-slow and CI run it
def test_mlp_out_bits_8_keeps_the_mlp_output_projections_in_8_bits(trained):
    model, _, exports = trained
    graph = onnx.load(str(exports["search, mlp out 8-bit"].folder / "model.onnx"), load_external_data=False).graph
    attributes = [
        {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for node in graph.node
        if node.op_type == "MatMulNBits"
    ]
    config = model.config
    eight = sorted((node["K"], node["N"]) for node in attributes if node["bits"] == 8)
    # The LM head and each layer's down projection; q/k/v, o and gate/up stay 4-bit.
    expected = [(config.intermediate_size, config.hidden_size)] * config.num_hidden_layers
    assert eight == sorted(expected + [(config.hidden_size, config.vocab_size)])
    assert all(node["bits"] == 4 for node in attributes if (node["K"], node["N"]) not in eight)
    assert load_manifest(exports["search, mlp out 8-bit"].folder)["validation"]["passed"]


def held_out_divergence(model, tokenizer, folder) -> float:
    """KL(float32 || export) per token over the vocabulary, on the end of the corpus: far from the calibration text
    (its first tokens) and from the training text."""
    from vaswani.runtime import OrtModelForCausalLM

    held_out = windows(corpus_text()[-20_000:], tokenizer)
    assert len(tokenizer(corpus_text()[:-20_000])["input_ids"]) > 10 * CALIBRATION_TOKENS
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=held_out).logits, dim=-1)
        quantized = torch.log_softmax(OrtModelForCausalLM.from_pretrained(folder)(input_ids=held_out).logits, dim=-1)
    return float((reference.exp() * (reference - quantized)).sum(dim=-1).mean())


@pytest.mark.slow  # a trained model and six int4 exports (29 s); make test-slow and CI run it
def test_gptq_is_closer_to_float32_than_rtn_on_held_out_text_of_its_calibration_domain(trained):
    model, tokenizer, exports = trained
    divergence = {method: held_out_divergence(model, tokenizer, exports[method].folder) for method in ("gptq", "rtn")}
    # gptq measured 3-7x closer on such models; `search` is not asserted here: on models this small it lands on
    # either side of RTN (its case is the real checkpoint, docs/results/int4_quality.md).
    assert divergence["gptq"] < 0.5 * divergence["rtn"]


def nbits_of(folder) -> list[dict]:
    """The attributes (K, N, bits, ...) of every MatMulNBits of an export's model graph."""
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return [
        {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for node in graph.node
        if node.op_type == "MatMulNBits"
    ]


def round_to_4_bits(weight: torch.Tensor, block: int) -> torch.Tensor:
    """Asymmetric round to nearest in 16 levels, one scale and zero point per `block` inputs of each output row, as
    ONNX Runtime's MatMulNBits quantizer does (the grid spans [min(w, 0), max(w, 0)]); written out here so that the
    oracle below does not use the module it checks."""
    rows = weight.double().numpy().reshape(weight.shape[0], -1, block)  # the test's widths are multiples of block
    low, high = np.minimum(rows.min(-1, keepdims=True), 0), np.maximum(rows.max(-1, keepdims=True), 0)
    scale = np.where(high > low, (high - low) / 15, 1.0)
    zero_point = np.round(-low / scale)
    levels = np.clip(np.round(rows / scale) + zero_point, 0, 15)
    return torch.from_numpy((levels - zero_point) * scale).reshape(weight.shape).to(weight.dtype)


def test_fisher_scores_rank_matrices_as_rounding_each_alone_does():
    """The oracle: round one matrix alone to 4 bits and measure the KL divergence it adds on the scoring text. To
    second order the score is twice that divergence (the diagonal of the Fisher information is what it keeps)."""
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    config = tiny_decoder_config(
        vocab_size=len(tokenizer),
        initializer_range=0.02,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_key_value_heads=2,
    )
    model = build_model(VaswaniForCausalLM, config)
    train_on_corpus(model, windows(corpus_text()[200_000:300_000], tokenizer, length=64, count=64), steps=100)
    scoring = windows(corpus_text()[:40_000], tokenizer, length=64, count=16)
    scores = fisher_row_scores(model, [row[None].numpy() for row in scoring], block_size=BLOCK)
    fisher, divergence = [], []
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=scoring).logits, dim=-1)
        for linear in model.modules():
            if not isinstance(linear, torch.nn.Linear) or linear is model.lm_head:
                continue
            weight = linear.weight.detach().clone()
            fisher.append(sum(scores[row_key(row)] for row in weight.numpy()))
            linear.weight.copy_(round_to_4_bits(weight, BLOCK))
            rounded = torch.log_softmax(model(input_ids=scoring).logits, dim=-1)
            linear.weight.copy_(weight)
            divergence.append(float((reference.exp() * (reference - rounded)).sum()))
    assert len(fisher) == 3 * 6  # q, k, v, o, up, down per layer

    def ranks(values):
        return np.argsort(np.argsort(values))

    spearman = np.corrcoef(ranks(fisher), ranks(divergence))[0, 1]
    assert spearman > 0.6, spearman  # measured 0.96
    ratio = np.median(np.array(fisher) / (2 * np.array(divergence)))
    assert 1 / 3 < ratio < 3, ratio  # measured 1.0-1.5 (sampling noise and the off-diagonal terms)


@pytest.mark.slow  # a trained model and six int4 exports (29 s); make test-slow and CI run it
def test_eight_bit_budget_keeps_the_listed_matmuls_in_8_bits_within_budget_and_closer_to_float32(trained):
    model, tokenizer, exports = trained
    folder = exports[f"budget {BUDGET}"].folder
    manifest = load_manifest(folder)
    chosen = manifest["quantization_options"]["eight_bit_matmuls"]["model"]
    assert manifest["quantization_options"]["eight_bit_budget"] == BUDGET and manifest["validation"]["passed"]
    # Every 4-bit matrix was ranked: a weight whose rows matched no scored row would never be chosen, silently.
    assert manifest["quantization_options"]["unscored_matmuls"] == {"model": []}
    assert chosen and not load_manifest(exports["budget 0.0"].folder)["quantization_options"].get("eight_bit_matmuls")
    nodes, plain = nbits_of(folder), nbits_of(exports["budget 0.0"].folder)
    assert len(nodes) == len(plain)
    eight = [node for node in nodes if node["bits"] == 8]
    assert len(eight) == 1 + len(chosen)  # the LM head, and the chosen ones
    four_bit_bytes = sum(node["K"] * node["N"] / 2 for node in plain if node["bits"] == 4)
    added = sum(node["K"] * node["N"] / 2 for node in eight if node["N"] != model.config.vocab_size)
    assert 0 < added <= BUDGET * four_bit_bytes
    budgeted = held_out_divergence(model, tokenizer, folder)
    assert budgeted < held_out_divergence(model, tokenizer, exports["budget 0.0"].folder)


@pytest.mark.slow  # a trained model and six int4 exports (29 s); make test-slow and CI run it
def test_the_default_budget_buys_more_than_a_smaller_one_and_weighs_search_by_the_inputs(trained):
    _, _, exports = trained
    options = load_manifest(exports["search"].folder)["quantization_options"]
    smaller = load_manifest(exports[f"budget {BUDGET}"].folder)["quantization_options"]
    assert options["eight_bit_budget"] == DEFAULT_EIGHT_BIT_BUDGET > BUDGET

    def eight_bit_bytes(folder):
        return sum(node["K"] * node["N"] for node in nbits_of(folder) if node["bits"] == 8)

    assert eight_bit_bytes(exports["search"].folder) > eight_bit_bytes(exports[f"budget {BUDGET}"].folder)
    assert options["input_weighted"] and smaller["input_weighted"]
    assert not load_manifest(exports["budget 0.0"].folder)["quantization_options"]["input_weighted"]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--quantize", "int8", "--int4-method", "gptq"], "int4_method applies to quantize='int4' only"),
        (["--int4-method", "gptq"], "int4 options apply to quantized exports"),
        (["--quantize", "int8", "--int4-mlp-out-bits", "8"], "int4_mlp_out_bits=8 needs quantize='int4'"),
        (["--quantize", "int8", "--int4-8bit-budget", "0.1"], "int4_8bit_budget=0.1 needs quantize='int4'"),
        (["--quantize", "int4", "--int4-8bit-budget", "1.5"], "is a fraction of the 4-bit weights' bytes in [0, 1)"),
        (["--quantize", "int8", "--int4-head-bits", "4"], "int4_head_bits=4 needs quantize='int4'"),
        (["--quantize", "int8", "--int4-symmetric"], "int4_symmetric applies to quantize='int4' only"),
    ],
    ids=[
        "int8",
        "unquantized",
        "mlp_out_bits_with_int8",
        "budget_with_int8",
        "budget_past_1",
        "head_bits_with_int8",
        "symmetric_with_int8",
    ],
)
def test_int4_method_outside_int4_is_a_clear_error(tmp_path, capsys, options, message):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    assert main(["export", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "out"), *options]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gptq_without_a_tokenizer_names_the_fix_before_any_work(tmp_path):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="tokenizer files, or use int4_method='search'"):
        export_onnx(tmp_path / "model", tmp_path / "out", quantize=Quantization.of("int4", method="gptq"))
    assert not (tmp_path / "out").exists()


def test_without_a_tokenizer_the_default_budget_says_so_and_an_explicit_one_is_an_error(tmp_path):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    lines = []
    result = export_onnx(tmp_path / "model", tmp_path / "out", quantize="int4", progress=lines.append)
    assert any("every body matrix stays 4-bit (there is no tokenizer beside the model)" in line for line in lines)
    options = result.manifest["quantization_options"]
    assert "eight_bit_matmuls" not in options and options["eight_bit_budget"] == 0
    assert {node["bits"] for node in nbits_of(tmp_path / "out")} == {4, 8}  # the body, the head
    # Asked for, even at the default's value, a budget that cannot be spent stops the export.
    for budget in (0.1, Quantization.of("int4").eight_bit_budget):
        with pytest.raises(ValueError, match="tokenizer files, or pass int4_8bit_budget=0"):
            export_onnx(tmp_path / "model", tmp_path / "out2", quantize=Quantization.of("int4", eight_bit_budget=budget))
        assert not (tmp_path / "out2").exists()


def test_a_tokenizer_outside_the_model_vocabulary_leaves_the_default_budget_unspent(tmp_path):
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))  # 64 tokens
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    lines = []
    export_onnx(tmp_path / "model", tmp_path / "out", quantize="int4", progress=lines.append)
    assert any("outside the model's vocabulary of 64" in line for line in lines)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 64"):
        export_onnx(tmp_path / "model", tmp_path / "out2", quantize=Quantization.of("int4", eight_bit_budget=0.5))


def test_head_bits_4_gives_an_all_4_bit_graph(tmp_path):
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    result = export_onnx(tmp_path / "model", tmp_path / "out", quantize=Quantization.of("int4", head_bits=4))
    assert result.manifest["quantization_options"]["head_bits"] == 4 and result.validation.passed
    nodes = nbits_of(tmp_path / "out")
    assert {node["bits"] for node in nodes} == {4} and any(node["N"] == model.config.vocab_size for node in nodes)


def test_gptq_calibrates_an_encoder_decoder_with_few_positions(tmp_path):
    """The decoder graph is calibrated on the encoder graph's cross keys/values, and windows fit the position table."""
    from conftest import tiny_seq2seq_config

    from vaswani import VaswaniForConditionalGeneration

    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    config = tiny_seq2seq_config(
        vocab_size=len(tokenizer), position_embedding_type="learned", num_hidden_layers=1, encoder_layers=1
    )
    model = build_model(VaswaniForConditionalGeneration, config)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = export_onnx(tmp_path / "model", tmp_path / "out", quantize=Quantization.of("int4", method="gptq"))
    assert result.validation.passed and config.max_position_embeddings < 256
    # Calibration ran each graph from a probe file beside it, which must not outlive it.
    assert not [path.name for path in (tmp_path / "out").iterdir() if "calibration" in path.name]
    for graph in ("encoder", "decoder"):
        file = tmp_path / "out" / result.manifest["graphs"][graph]["file"]
        nodes = onnx.load(str(file), load_external_data=False).graph.node
        assert any(node.op_type == "MatMulNBits" for node in nodes)


def test_fisher_scoring_holds_one_gradient_at_a_time():
    """The 8-bit budget's scoring squares each weight's gradient into its total as the backward pass makes it and drops
    it: never the whole model's gradients at once (a second copy of a 1B model's weights). Observed by a hook that
    runs as each gradient lands, beside the scorer's own; afterwards no gradient is left and `requires_grad` is as it
    was. The scores themselves are checked against the KL divergence above."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=2))
    model.model.norm.weight.requires_grad_(False)
    wanted = [parameter.requires_grad for parameter in model.parameters()]
    alive = []
    for linear in [module for module in model.modules() if isinstance(module, torch.nn.Linear)]:
        linear.weight.register_post_accumulate_grad_hook(
            lambda _: alive.append(sum(other.grad is not None for other in model.parameters()))
        )
    windows = [np.random.default_rng(seed).integers(0, model.config.vocab_size, (1, 16)) for seed in range(2)]
    scores = fisher_row_scores(model, windows, block_size=BLOCK)
    assert scores and len(alive) == 2 * 2 * 6 and set(alive) == {1}  # 2 windows x 2 layers x 6 matrices, one at a time
    assert all(parameter.grad is None for parameter in model.parameters())
    assert [parameter.requires_grad for parameter in model.parameters()] == wanted


def test_fisher_scores_summed_in_slices_of_rows_are_the_whole_matrices_scores(monkeypatch):
    """The scores are summed over slices of rows that stay in the CPU's cache; slices of 3 rows (ragged against
    every matrix here) give the scores of one slice per matrix, to float rounding."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=2))
    windows = [np.random.default_rng(seed).integers(0, model.config.vocab_size, (1, 16)) for seed in range(2)]
    monkeypatch.setattr(sensitivity, "SCORING_SLICE_ELEMENTS", 10**9)
    whole = fisher_row_scores(model, windows, block_size=BLOCK)
    columns = {module.weight.shape[1] for module in model.modules() if isinstance(module, torch.nn.Linear)}
    monkeypatch.setattr(sensitivity, "SCORING_SLICE_ELEMENTS", 3 * min(columns))
    sliced = fisher_row_scores(model, windows, block_size=BLOCK)
    assert sliced.keys() == whole.keys() and any(value != 0 for value in whole.values())
    np.testing.assert_allclose([sliced[key] for key in whole], list(whole.values()), rtol=1e-5, atol=1e-12)


def test_fisher_scores_weigh_each_windows_squared_gradient_as_summing_the_fisher_information_first_does():
    """The scorer weighs each window's squared gradient by the rounding gain as the gradient lands, never holding the
    Fisher information itself (the model's size again). The oracle sums the squared gradients of each window first
    (autograd, the same sampled labels) and weighs the total after: the same scores, to float rounding."""
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=2)).eval()
    windows = [np.random.default_rng(seed).integers(0, model.config.vocab_size, (1, 16)) for seed in range(3)]
    scores = fisher_row_scores(model, windows, block_size=BLOCK, seed=5)

    head = model.get_output_embeddings().weight
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    weights = list(dict.fromkeys(linear.weight for linear in linears if linear.weight is not head))
    fisher = [torch.zeros_like(weight) for weight in weights]
    generator = torch.Generator().manual_seed(5)
    for window in windows:
        logits = model(input_ids=torch.as_tensor(window)).logits.float().reshape(-1, model.config.vocab_size)
        labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=generator).squeeze(1)
        gradients = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"), weights)
        for total, gradient in zip(fisher, gradients):
            total += gradient.square()
    expected: dict[int, float] = {}
    for weight, information in zip(weights, fisher):
        weight = weight.detach()
        gain = rounding_error(weight, 4, BLOCK, symmetric=False).square()
        gain -= rounding_error(weight, 8, BLOCK, symmetric=True).square()
        for row, value in zip(weight.numpy(), (information.double() * gain.double()).sum(1).tolist()):
            expected[row_key(row)] = expected.get(row_key(row), 0.0) + value
    assert scores.keys() == expected.keys() and any(value > 0 for value in expected.values())
    np.testing.assert_allclose([scores[key] for key in expected], list(expected.values()), rtol=1e-4, atol=1e-12)
