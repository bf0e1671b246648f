"""OpenVINO as the prompt engine of an exported decoder (`engine="openvino"`: prompt steps in OpenVINO, one-token
steps in ONNX Runtime). Oracles: transformers' own LlamaForCausalLM with the same weights (logits, greedy tokens; a
quantized graph's weights dequantized from its initializers), ONNX Runtime's tokens, the exporter's validation
rules, offline `generate` for `vaswani serve --engine openvino`.

On a CPU without bfloat16 (AVX2 only) OpenVINO computes "bf16" in float32 or emulated; the bf16 tests compare with
transformers' bfloat16 model on the same machine, so they hold either way."""

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_decoder_config
from serving_cases import (
    free_port,
    offline_answer,
    saved_tiny_chat_llama,
    server_answers,
    wait_for,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from vaswani import VaswaniForCausalLM
from vaswani.cli.main import main as vaswani_cli
from vaswani.conversion.checkpoints import from_transformers
from vaswani.runtime.contract import positions_from_mask

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")

from vaswani.export import OnnxValidationError, export_onnx, trace_onnx, validate_onnx_export  # noqa: E402
from vaswani.export.validation import TOLERANCES, allowed_difference  # noqa: E402
from vaswani.quantization import Quantization  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402
from vaswani.runtime.contract import load_manifest  # noqa: E402
from vaswani.runtime.decoders import chosen_engine  # noqa: E402
from vaswani.runtime.decoders.openvino import OpenVinoRuntime, OpenVinoStepModel  # noqa: E402
from vaswani.runtime.decoders.paged import PagedStepModel  # noqa: E402
from vaswani.runtime.openvino import (  # noqa: E402
    OpenVinoDecoder,
    OpenVinoSession,
    amx_left_padding,
    cpu_has_int8_dot_products,
    decode_step_precision,
    openvino_precision,
    route_description,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[LlamaForCausalLM, Path]:
    """transformers' LlamaForCausalLM (tiny, random, grouped-query, head_dim 16) and its saved folder, with the tiny
    chat tokenizer (the commands load one)."""
    folder = tmp_path_factory.mktemp("openvino") / "llama"
    return saved_tiny_chat_llama(folder), folder


@pytest.fixture(scope="module")
def exports(llama) -> dict[str, Path]:
    """The Llama folder exported portable (fp32; what OpenVINO reads), in the default int8 form (ONNX Runtime's
    GroupQueryAttention, which OpenVINO cannot read, with the portable graph it carries for OpenVINO), the same without
    that graph (as exports were written before they carried it), in int8 portable, and in int4 portable computing in
    float32 (accuracy level 0; every body matrix in 4 bits with zero points, the head in 8)."""
    _, folder = llama
    forms = {
        "portable": {},
        "gqa-int8": {"quantize": "int8"},
        "portable-int8": {"quantize": "int8", "attention": "portable"},
        "portable-int4-float-compute": {
            "quantize": Quantization.of("int4", accuracy_level=0, eight_bit_budget=0.0),
            "attention": "portable",
        },
    }
    with trace_onnx(folder, task="text-generation") as traced:  # one trace, every form derived from it
        folders = {
            name: traced.export(folder.parent / name, validate=False, **options).folder
            for name, options in forms.items()
        }
    folders["gqa-int8-alone"] = without_portable_graph(folders["gqa-int8"], folder.parent / "gqa-int8-alone")
    return folders


def without_portable_graph(folder: Path, copy: Path) -> Path:
    """A copy of a GroupQueryAttention-form export without the portable graph it carries."""
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for graph in manifest.pop("portable_form")["graphs"].values():
        (copy / graph["file"]).unlink()
        (copy / f"{graph['file']}.data").unlink()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def left_padded(batch_lengths: list[int], length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (len(batch_lengths), length), generator=generator)
    mask = torch.zeros_like(ids)
    for row, real in enumerate(batch_lengths):
        mask[row, length - real :] = 1
        ids[row, : length - real] = 0
    return ids, mask


class CallCounter:
    """Wraps a session's `run`, counting the calls (which engine ran what)."""

    @classmethod
    def both(cls, model) -> tuple["CallCounter", "CallCounter"]:
        """Counters of OpenVINO's stateless runs (prompts) and ONNX Runtime's session's runs (one-token steps)."""
        return cls(model.decoder_runtime.openvino), cls(model.graphs["model"].session)

    def __init__(self, session):
        self.calls, self.run_inner = 0, session.run
        session.run = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.run_inner(*args, **kwargs)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_openvino_prompt_logits_match_transformers_llama(precision, llama, exports):
    """A left-padded prompt batch run by OpenVINO gives transformers' Llama logits at every real token: within the
    exporter's fp32 tolerance in f32; in bf16 within the half-precision rule against Llama in bfloat16 (3x its own
    bfloat16 error, measured against its float32 logits)."""
    reference, _ = llama
    model = OrtModelForCausalLM.from_pretrained(exports["portable"], engine="openvino", openvino_precision=precision)
    prompt_runs, _ = CallCounter.both(model)
    ids, mask = left_padded([9, 5, 2], 9, reference.config.vocab_size)
    actual = model(ids, attention_mask=mask).logits
    assert prompt_runs.calls == 1 and model.provider == f"OpenVINO ({precision})"
    assert isinstance(model.decoder_runtime, OpenVinoRuntime)
    positions = positions_from_mask(mask)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        real = mask.bool()
        scale = float(expected[real].abs().max())
        if precision == "f32":
            kind, tolerance = TOLERANCES["fp32"]
            allowed = allowed_difference(kind, tolerance, scale, reference.config.num_hidden_layers)
        else:
            float32 = expected
            bfloat16 = copy.deepcopy(reference).to(torch.bfloat16)  # the module fixture's model stays float32
            expected = bfloat16(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            own_error = float((expected.float() - float32)[real].abs().max())
            kind, tolerance = TOLERANCES["fp16"]
            allowed = allowed_difference(kind, tolerance, scale, reference.config.num_hidden_layers, own_error)
    difference = float((actual - expected.float())[real].abs().max())
    assert difference <= allowed, (difference, allowed)


def test_greedy_generate_with_openvino_prompts_continues_in_onnxruntime_at_one_row_quantized(exports):
    """A quantized export at batch 1 keeps the route (ONNX Runtime's decode steps were faster there): OpenVINO prefills
    in f32, ONNX Runtime decodes from OpenVINO's cache, and the greedy tokens are ONNX Runtime's alone."""
    ids = torch.randint(3, 60, (1, 7), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    routed = OrtModelForCausalLM.from_pretrained(exports["portable-int8"], engine="openvino", openvino_precision="f32")
    prompt_runs, step_runs = CallCounter.both(routed)
    tokens = routed.generate(ids, **options)
    assert (prompt_runs.calls, step_runs.calls) == (1, 7)  # the prompt in OpenVINO, the 7 later tokens' steps in ORT
    alone = OrtModelForCausalLM.from_pretrained(exports["portable-int8"]).generate(ids, **options)
    assert torch.equal(tokens, alone)


def test_the_default_export_opens_its_gqa_session_only_for_one_rows_steps(exports, monkeypatch):
    """Memory: under engine="openvino" a small default export's GroupQueryAttention form is loaded by ONNX Runtime
    for one row's decode steps only. A server's paged batch and two-row generation open no ONNX Runtime session; the
    first one-row generation opens that form's, once, and its tokens are the default engine's."""
    import onnxruntime

    sessions, session_class = [], onnxruntime.InferenceSession

    class CountedSession(session_class):
        def __init__(self, path, *args, **kwargs):
            sessions.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", CountedSession)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    routed = OrtModelForCausalLM.from_pretrained(exports["gqa-int8"], engine="openvino", openvino_precision="f32")
    assert routed.decoder_runtime.one_row_steps is not None
    routed.decoder_runtime.step_model()
    routed.generate(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), **options)
    assert sessions == []
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    tokens = [routed.generate(ids, **options) for _ in range(2)]
    assert sessions == ["model.onnx"]  # the GroupQueryAttention form's graph, once
    monkeypatch.undo()
    expected = OrtModelForCausalLM.from_pretrained(exports["gqa-int8"]).generate(ids, **options)
    for got in tokens:
        assert torch.equal(got, expected)


def test_one_row_of_the_default_export_prefills_in_openvino_and_steps_in_its_gqa_form(exports, monkeypatch):
    """The default export under engine="openvino", one row of a small quantized export: OpenVINO prefills, the
    GroupQueryAttention form decodes from OpenVINO's cache (padding columns dropped: a bf16 prompt on AMX is padded
    on the left), the portable graph's ONNX Runtime session runs nothing, and the greedy tokens are ONNX Runtime's
    own run of that form's. Two rows, or a large export, decode in OpenVINO as before."""
    from vaswani.runtime import openvino as openvino_module
    from vaswani.runtime.decoders import openvino as openvino_decoder

    monkeypatch.setattr(openvino_module, "cpu_has_amx", lambda: True)  # the prompt padded to 128 columns
    ids = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    routed = OrtModelForCausalLM.from_pretrained(exports["gqa-int8"], engine="openvino", openvino_precision="f32")
    runtime = routed.decoder_runtime
    assert runtime.one_row_steps is not None and "GroupQueryAttention" in runtime.description
    prompt_runs, portable_runs = CallCounter.both(routed)
    infers, infer = [], runtime.openvino.infer
    monkeypatch.setattr(runtime.openvino, "infer", lambda *args: infers.append(args[1].shape) or infer(*args))
    monkeypatch.setattr(runtime.openvino, "pads_prompts", True)
    steps, run = [], runtime.one_row_steps.gqa.session.run_with_iobinding
    monkeypatch.setattr(runtime.one_row_steps.gqa.session, "run_with_iobinding", lambda b: steps.append(1) or run(b))
    tokens = routed.generate(ids, **options)
    assert infers == [(1, 128)] and len(steps) == 7  # the padded prompt in OpenVINO, the 7 later tokens' steps in ORT
    assert (prompt_runs.calls, portable_runs.calls) == (0, 0)
    alone = OrtModelForCausalLM.from_pretrained(exports["gqa-int8"])
    assert alone.decoder_runtime.name == "gqa"
    assert torch.equal(tokens, alone.generate(ids, **options))
    two_rows = torch.cat([ids, ids.flip(1)])
    assert runtime.decodes_in_openvino(2)
    assert torch.equal(routed.generate(two_rows, **options), alone.generate(two_rows, **options))
    # Where one row decodes in OpenVINO too (a large export whose steps compute in f32 beside bf16 prompts), the
    # GroupQueryAttention form is not loaded.
    monkeypatch.setattr(openvino_decoder.OpenVinoRuntime, "decodes_in_openvino", lambda self, batch: True)
    large = OrtModelForCausalLM.from_pretrained(exports["gqa-int8"], engine="openvino", openvino_precision="f32")
    assert large.decoder_runtime.one_row_steps is None


def test_quantized_generate_prefills_in_bf16_and_steps_in_f32_within_pytorchs_error(
    llama, exports, monkeypatch, caplog
):
    """Under "auto", a quantized export on a CPU with bf16 and int8 dot products (both faked here, so any CPU runs it;
    OpenVINO emulates bf16 where the CPU lacks it) prefills in bf16 and decodes in a second graph compiled at f32,
    which takes the prompt's cache over once. The choice is logged, the provider says it, every step runs in the f32
    graph, and every logit generate chose by is within the error model of PyTorch computing the graph's weights:
    the half-precision rule against that model in bfloat16 (the prompt's compute) plus twice what rounding the
    matmuls' inputs to int8 moves (the steps' dynamic quantization), as in the batch test below."""
    from vaswani.runtime import openvino as openvino_module
    from vaswani.runtime.decoders import openvino as openvino_decoder

    reference, _ = llama
    monkeypatch.setattr(openvino_decoder, "openvino_precision", lambda requested: "bf16")
    monkeypatch.setattr(openvino_module, "cpu_has_int8_dot_products", lambda: True)
    with caplog.at_level(logging.INFO, logger="vaswani.runtime.openvino"):
        model = OrtModelForCausalLM.from_pretrained(exports["portable-int8"], engine="openvino")
    assert model.provider == "OpenVINO (bf16 prompts, f32 steps)"
    assert any("decode steps of the quantized weights in f32" in record.getMessage() for record in caplog.records)
    decoder = model.decoder_runtime.openvino
    step_requests, logits_returned = [], []
    new_step_request, start, decode = decoder.new_step_request, decoder.start, decoder.decode
    decoder.new_step_request = lambda: step_requests.append(new_step_request()) or step_requests[-1]
    decoder.start = lambda *args: logits_returned.append(start(*args)) or logits_returned[-1]
    decoder.decode = lambda *args: logits_returned.append((decode(*args),)) or logits_returned[-1][0]
    _, step_runs = CallCounter.both(model)
    ids, mask = left_padded([7, 4], 7, reference.config.vocab_size)
    new = 6
    sequences = model.generate(
        ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    assert step_runs.calls == 0 and len(step_requests) == 1  # two rows: every step in OpenVINO, one handover
    # One row: ONNX Runtime's steps below ONE_ROW_OPENVINO_BYTES of graph files (this tiny export), OpenVINO's above.
    assert not model.decoder_runtime.decodes_in_openvino(1)
    monkeypatch.setattr(openvino_decoder, "ONE_ROW_OPENVINO_BYTES", model.decoder_runtime.graph_bytes)
    assert model.decoder_runtime.decodes_in_openvino(1)
    assert step_requests[0].get_compiled_model().get_property("INFERENCE_PRECISION_HINT").to_string() == "f32"
    manifest = load_manifest(exports["portable-int8"])
    oracle = with_graph_weights(reference, exports["portable-int8"] / "model.onnx")
    rounding = with_int8_activations(oracle, manifest["quantization_options"]["block_size"])
    in_bfloat16 = copy.deepcopy(oracle).to(torch.bfloat16)
    kind, tolerance = TOLERANCES["fp16"]
    seen_all = torch.stack([returned[0] for returned in logits_returned], 1).numpy()  # (rows, new - 1, vocab)
    for row in range(2):
        prompt = ids[row][mask[row].bool()].tolist()
        tokens = sequences[row, ids.shape[1] :].tolist()
        seen = seen_all[row].copy()
        expected = teacher_forced_logits(oracle, prompt, tokens)
        rounded = teacher_forced_logits(rounding, prompt, tokens)
        halved = teacher_forced_logits(in_bfloat16, prompt, tokens)
        assert seen.shape == expected.shape == (new, reference.config.vocab_size)
        for logits in (seen, expected, rounded, halved):
            logits[:, model.config.eos_token_id] = 0.0  # min_new_tokens holds it back in generate's logits
        scale = float(np.abs(expected).max())
        own_error = float(np.abs(halved - expected).max())
        allowed = allowed_difference(kind, tolerance, scale, reference.config.num_hidden_layers, own_error)
        allowed += 2 * float(np.abs(rounded - expected).max())
        difference = float(np.abs(seen - expected).max())
        assert difference <= allowed, (row, difference, allowed)


def test_a_prompt_padded_to_amx_multiple_decodes_as_the_unpadded_one(llama, exports):
    """`OpenVinoDecoder.start` on AMX at bf16 pads a prompt on the left to a multiple of 128 tokens; forced here at f32
    (so any CPU runs it, and the two runs compare to float rounding): two rows of 37 tokens, one of them left-padded
    already, run as 2 x 64, and the first logits and those of six steps after it equal the unpadded decoder's within
    the exporter's fp32 rule."""
    reference, _ = llama
    path, manifest = exports["portable"] / "model.onnx", load_manifest(exports["portable"])
    padded, plain = OpenVinoDecoder(path, manifest, "f32", 2), OpenVinoDecoder(path, manifest, "f32", 2)
    padded.pads_prompts = True
    shapes = []
    infer = padded.infer
    padded.infer = lambda request, input_ids, *rest: shapes.append(input_ids.shape) or infer(request, input_ids, *rest)
    ids, mask = left_padded([37, 30], 37, reference.config.vocab_size)
    tokens = torch.randint(3, 60, (6, 2), generator=torch.Generator().manual_seed(3))
    runs = []
    for decoder in (padded, plain):
        logits, state = decoder.start(ids, mask)
        runs.append(torch.stack([logits] + [decoder.decode(state, step) for step in tokens]))
    assert shapes[0] == (2, 64) and all(shape == (2, 1) for shape in shapes[1:])
    kind, tolerance = TOLERANCES["fp32"]
    scale = float(runs[1].abs().max())
    allowed = allowed_difference(kind, tolerance, scale, reference.config.num_hidden_layers)
    assert float((runs[0] - runs[1]).abs().max()) <= allowed


def test_amx_left_padding_reaches_the_multiple_for_fewer_tokens_than_it():
    assert [amx_left_padding(rows, columns) for rows, columns in [(8, 57), (1, 456), (3, 100), (1, 65)]] == [
        7, 56, 28, 63,
    ]  # fmt: skip
    # At or under 64 tokens, at a multiple already, or where the multiple takes 128 padding tokens or more: none.
    assert [amx_left_padding(rows, columns) for rows, columns in [(1, 64), (16, 1), (1, 512), (5, 100)]] == [0] * 4


def test_decode_steps_compute_in_f32_only_for_quantized_exports_under_auto_with_int8_dot_products(monkeypatch):
    """The rule of `decode_step_precision`: f32 steps beside bf16 prompts only where "auto" chose bf16 for a quantized
    export on a CPU with int8 dot products; an explicit precision, an unquantized export, f32 prompts or a CPU
    without int8 dot products keep the steps in the prompts' precision."""
    from vaswani.runtime import openvino as openvino_module

    for dot_products in (True, False):
        monkeypatch.setattr(openvino_module, "cpu_has_int8_dot_products", lambda found=dot_products: found)
        assert decode_step_precision("auto", "bf16", quantized=True) == ("f32" if dot_products else "bf16")
        assert decode_step_precision("auto", "bf16", quantized=False) == "bf16"
        assert decode_step_precision("bf16", "bf16", quantized=True) == "bf16"
        assert decode_step_precision("auto", "f32", quantized=True) == "f32"


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_runs_every_step_in_stateful_openvino_and_matches_transformers(do_sample, llama, exports):
    """An unquantized export: `generate` runs the prompt and every step in OpenVINO with the cache held inside (the
    route's sessions are not called). f32, a left-padded batch: greedy tokens equal ONNX Runtime's alone and
    transformers' Llama's; sampling with the same seed draws ONNX Runtime's tokens."""
    reference, _ = llama
    ids, mask = left_padded([7, 4, 1], 7, reference.config.vocab_size)
    options = dict(attention_mask=mask, max_new_tokens=9, do_sample=do_sample, pad_token_id=0, top_k=5)
    model = OrtModelForCausalLM.from_pretrained(exports["portable"], engine="openvino", openvino_precision="f32")
    prompt_runs, step_runs = CallCounter.both(model)
    torch.manual_seed(3)
    tokens = model.generate(ids, **options)
    assert (prompt_runs.calls, step_runs.calls) == (0, 0)  # neither the route's prompt calls nor its steps
    torch.manual_seed(3)
    alone = OrtModelForCausalLM.from_pretrained(exports["portable"]).generate(ids, **options)
    assert torch.equal(tokens, alone)
    if not do_sample:
        with torch.no_grad():
            assert torch.equal(tokens, reference.generate(ids, **options))


def test_stateful_openvino_generate_in_bf16_follows_transformers_bfloat16(llama, exports):
    """bf16 compute (emulated or f32 where the CPU lacks it): the stateful loop's first greedy tokens are those of
    transformers' Llama in bfloat16 up to where the two precisions' own tokens part (a chaotic tiny network)."""
    reference, _ = llama
    ids, mask = left_padded([6, 6], 6, reference.config.vocab_size)
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model = OrtModelForCausalLM.from_pretrained(exports["portable"], engine="openvino", openvino_precision="bf16")
    tokens = model.generate(ids, **options)
    with torch.no_grad():
        float32 = reference.generate(ids, **options)
        bfloat16 = copy.deepcopy(reference).to(torch.bfloat16).generate(ids, **options)
    new = slice(ids.shape[1], None)
    # The new tokens up to where float32 and bfloat16 part (at least the first: else this test could not fail).
    agreeing = ids.shape[1] + int((float32[:, new] == bfloat16[:, new]).all(0).int().cumprod(0).sum())
    assert agreeing > ids.shape[1] and torch.equal(tokens[:, :agreeing], float32[:, :agreeing]), agreeing


def test_beam_search_with_openvino_runs_through_the_route(exports):
    """Beam search is not the held-cache loop's: it runs `forward` (the route) and gives ONNX Runtime's beams."""
    ids = torch.randint(3, 60, (1, 5), generator=torch.Generator().manual_seed(4))
    options = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    model = OrtModelForCausalLM.from_pretrained(exports["portable"], engine="openvino", openvino_precision="f32")
    prompt_runs, _ = CallCounter.both(model)
    tokens = model.generate(ids, **options)
    assert prompt_runs.calls == 1
    assert torch.equal(tokens, OrtModelForCausalLM.from_pretrained(exports["portable"]).generate(ids, **options))


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_validation_judges_openvino_by_the_exporters_rules(precision, tmp_path, exports):
    """`validate_onnx_export(engine="openvino")` passes the export against the model it came from, and fails it
    against another model (so the rules can fail: here, one weight of the model changed)."""
    vaswani_model = from_transformers(AutoModelForCausalLM.from_pretrained(exports["portable"].parent / "llama"))
    report = validate_onnx_export(exports["portable"], vaswani_model, engine="openvino", openvino_precision=precision)
    assert report.passed and report.provider == f"OpenVINO ({precision})"
    assert report.tolerance_kind == ("relative per layer" if precision == "f32" else "half precision")
    with torch.no_grad():
        vaswani_model.get_decoder().layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(OnnxValidationError, match="logits"):
        validate_onnx_export(exports["portable"], vaswani_model, engine="openvino", openvino_precision=precision)


def test_auto_picks_bf16_and_the_openvino_route_exactly_where_openvino_lists_bf16(exports):
    """Precision "auto" is bf16 where OpenVINO lists BF16 among the CPU's capabilities; engine "auto" takes the route
    there for a portable export, and ONNX Runtime for the GroupQueryAttention form, elsewhere, or on CUDA."""
    import openvino

    has_bf16 = "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    assert openvino_precision("auto") == ("bf16" if has_bf16 else "f32")
    assert openvino_precision("f32") == "f32"
    with pytest.raises(ValueError, match="'auto', 'f32', 'bf16'"):
        openvino_precision("fp16")
    portable, gqa = (load_manifest(exports[name]) for name in ("portable", "gqa-int8-alone"))
    assert chosen_engine("auto", portable, "CPUExecutionProvider") == ("openvino" if has_bf16 else "onnxruntime")
    assert chosen_engine("auto", gqa, "CPUExecutionProvider") == "onnxruntime"
    assert chosen_engine("auto", portable, "CUDAExecutionProvider") == "onnxruntime"
    assert chosen_engine("openvino", gqa, "CPUExecutionProvider") == "openvino"  # asked for: refused with the fix
    model = OrtModelForCausalLM.from_pretrained(exports["portable"], engine="auto")
    assert model.provider == ("OpenVINO (bf16)" if has_bf16 else "CPUExecutionProvider")


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("int8_dot_products", [True, False])
def test_auto_takes_the_route_for_quantized_exports_where_the_cpu_has_int8_dot_products(
    exports, monkeypatch, caplog, bf16, int8_dot_products
):
    """Without bfloat16, OpenVINO's f32 lost to ONNX Runtime on an AVX2-only CPU, while with VNNI its int8 products
    ran quantized exports faster (docs/deployment.md): the route for a quantized portable export where the CPU has
    either, and for the default export, through the portable graph it carries; for an fp32 export only with bfloat16;
    never for a GroupQueryAttention form without its portable graph. Each choice is logged."""
    from vaswani.runtime.decoders import openvino as openvino_runtime

    monkeypatch.setattr(openvino_runtime, "openvino_precision", lambda requested="auto": "bf16" if bf16 else "f32")
    monkeypatch.setattr(openvino_runtime, "cpu_has_int8_dot_products", lambda: int8_dot_products)
    names = ("portable", "portable-int8", "gqa-int8", "gqa-int8-alone")
    manifests = {name: load_manifest(exports[name]) for name in names}
    caplog.set_level(logging.INFO, logger="vaswani.runtime.decoders")
    chosen = {name: chosen_engine("auto", manifest, "CPUExecutionProvider") for name, manifest in manifests.items()}
    assert chosen == {
        "portable": "openvino" if bf16 else "onnxruntime",
        "portable-int8": "openvino" if bf16 or int8_dot_products else "onnxruntime",
        "gqa-int8": "openvino" if bf16 or int8_dot_products else "onnxruntime",
        "gqa-int8-alone": "onnxruntime",
    }
    said = [record.getMessage() for record in caplog.records]
    assert len([line for line in said if line.startswith("engine='auto' runs") and "OpenVINO" in line]) == 4


def test_int8_dot_products_are_read_from_the_cpu_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not cpu_has_int8_dot_products(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert cpu_has_int8_dot_products(cpuinfo)
    assert not cpu_has_int8_dot_products(tmp_path / "missing")  # another operating system: ONNX Runtime stays


def test_groupqueryattention_form_without_its_portable_graph_is_refused_with_the_fix(exports, capsys):
    """The default quantized form holds ONNX Runtime-only operators: where the export lacks the portable graph beside
    it (written before exports carried one), loading it, validating it and reading its graph directly each say so
    and name `vaswani export --attention portable`."""
    folder = exports["gqa-int8-alone"]
    with pytest.raises(ValueError, match="GroupQueryAttention.*--attention portable"):
        OrtModelForCausalLM.from_pretrained(folder, engine="openvino")
    with pytest.raises(ValueError, match="GroupQueryAttention.*--attention portable"):
        OpenVinoSession(folder / "model.onnx", "f32", 1)
    assert vaswani_cli(["bench", str(folder), "--engine", "openvino", "--new-tokens", "2", "--rounds", "1"]) == 2
    assert "--attention portable" in capsys.readouterr().err


def test_engine_openvino_is_refused_for_a_pytorch_folder(llama, capsys):
    _, folder = llama
    assert vaswani_cli(["bench", str(folder), "--engine", "openvino", "--new-tokens", "2", "--rounds", "1"]) == 2
    assert "runs ONNX exports" in capsys.readouterr().err


def test_serve_engine_openvino_answers_a_chat_like_offline_generate(tiny_chat_pair):
    """`vaswani serve --engine openvino` (a process of its own): a greedy chat answer equals the PyTorch folder's
    offline `generate`, and the startup line says which engine runs what."""
    import httpx

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "vaswani.cli.main", "serve", str(tiny_chat_pair["onnx"]), "--engine", "openvino"]
        + ["--openvino-precision", "f32", "--threads", "1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    try:
        assert wait_for(server_answers(http, process), timeout=120) and process.poll() is None, (
            process.stdout.read().decode()
        )
        messages = [{"role": "user", "content": "Tell me a story."}]
        body = {"model": "tiny-chat", "messages": messages, "max_tokens": 12, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    finally:
        http.close()
        process.terminate()
        log = process.communicate(timeout=60)[0].decode()
    # The served batch is the paged one: every call OpenVINO's (offline `generate` takes the route instead).
    assert "every call in OpenVINO's paged graph (f32), the KV cache in f16 blocks" in log, log
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_pair["pytorch"])
    offline = AutoModelForCausalLM.from_pretrained(tiny_chat_pair["pytorch"]).eval()
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    text, _ = offline_answer(offline, tokenizer, prompt, 12)
    assert response.json()["choices"][0]["message"]["content"] == text


def test_bench_and_perplexity_commands_take_the_engine(exports, tmp_path, capsys):
    """`vaswani bench --engine openvino` says in its JSON what ran; `vaswani perplexity --engine openvino` (f32) scores
    the text as ONNX Runtime does (every window is a prompt step, so OpenVINO scores it)."""
    folder = str(exports["portable"])
    output = tmp_path / "bench.json"
    settings = ["--batch-sizes", "1", "--prompt-tokens", "8", "--new-tokens", "3", "--rounds", "1", "--threads", "1"]
    assert vaswani_cli(["bench", folder, "--engine", "openvino", *settings, "--json", str(output)]) == 0
    engine = json.loads(output.read_text())["engine"]
    assert engine in (route_description("OpenVINO (f32)"), route_description("OpenVINO (bf16)"))
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat who liked to sleep in the sun. " * 8)
    scores = {}
    for engine in ("onnxruntime", "openvino"):
        flags = ["--engine", engine, "--openvino-precision", "f32", "--context", "32", "--stride", "16"]
        assert vaswani_cli(["perplexity", folder, "--text", str(text), *flags, "--json", str(output)]) == 0
        scores[engine] = json.loads(output.read_text())["perplexity"]
    assert scores["openvino"] == pytest.approx(scores["onnxruntime"], rel=1e-4)


def test_without_openvino_the_engine_names_the_extra_and_auto_keeps_onnxruntime(exports, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'vaswani\[openvino\]'"):
        OrtModelForCausalLM.from_pretrained(exports["portable"], engine="openvino")
    assert chosen_engine("auto", load_manifest(exports["portable"]), "CPUExecutionProvider") == "onnxruntime"


@pytest.mark.parametrize("threads", [1, 2])
def test_openvino_takes_onnxruntimes_thread_count_and_the_precision_asked(threads, exports):
    from vaswani.runtime import default_session_options

    options = default_session_options(threads)
    model = OrtModelForCausalLM.from_pretrained(
        exports["portable"], session_options=options, engine="openvino", openvino_precision="bf16"
    )
    compiled = model.decoder_runtime.openvino.compiled
    assert compiled.get_property("INFERENCE_NUM_THREADS") == threads
    if openvino_precision("auto") == "bf16":  # elsewhere OpenVINO may run the bf16 hint in f32
        assert "bfloat16" in str(compiled.get_property("INFERENCE_PRECISION_HINT"))


def teacher_forced_logits(model, prompt: list[int], generated: list[int], rows: int = 1) -> np.ndarray:
    """The logits that chose each of `generated` after `prompt`, from one uncached pass over the whole sequence (the
    sequence repeated over `rows` rows; the first row's logits). `model`: an ONNX or a PyTorch causal LM."""
    sequence = torch.tensor([prompt + generated[:-1]] * rows)
    with torch.no_grad():
        logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence)).logits
    return logits[0, len(prompt) - 1 :].float().numpy()


def dequantized_matmuls(graph_path: Path) -> list[np.ndarray]:
    """Each `MatMulNBits` of a graph as the float weight it multiplies by, [N, K], read from its initializers in ONNX
    Runtime's layout: B packed uint8 [N, blocks, block_size * bits / 8] (4-bit integers two a byte, the low nibble
    first), scales [N, blocks], zero points packed as B is, [N, ...] (none stored: the middle of the range,
    2^(bits - 1)). The weight is (integer - zero point) * scale."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(graph_path)).graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}

    def integers(name: str, bits: int, rows: int) -> np.ndarray:
        packed = numpy_helper.to_array(initializers[name]).reshape(rows, -1)
        return packed if bits == 8 else np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)

    matmuls = []
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}
        k, n, bits, block = attributes["K"], attributes["N"], attributes["bits"], attributes["block_size"]
        blocks = -(-k // block)
        values = integers(node.input[1], bits, n).reshape(n, blocks, block).astype(np.float32)
        scales = numpy_helper.to_array(initializers[node.input[2]]).reshape(n, blocks).astype(np.float32)
        if len(node.input) > 3 and node.input[3]:
            zero_points = integers(node.input[3], bits, n)[:, :blocks]
        else:
            zero_points = np.full((n, blocks), 2 ** (bits - 1))
        weight = (values - zero_points[..., None].astype(np.float32)) * scales[..., None]
        matmuls.append(weight.reshape(n, blocks * block)[:, :k])
    return matmuls


def with_graph_weights(model: LlamaForCausalLM, graph_path: Path) -> LlamaForCausalLM:
    """A copy of `model` whose every linear layer multiplies by the quantized graph's weights (`dequantized_matmuls`):
    PyTorch computing what the graph's weights say, engine-free. Each of the model's rows takes the graph row nearest
    to it (the graph fuses q/k/v and gate/up, and transposes), which must be unambiguous: at most a quarter of the
    squared distance to the next nearest (rounding moves a row far less than rows of a random model lie apart)."""
    matmuls = dequantized_matmuls(graph_path)
    copied = copy.deepcopy(model)
    for name, linear in copied.named_modules():
        if not isinstance(linear, torch.nn.Linear):
            continue
        weight = linear.weight.detach().numpy()
        rows = np.concatenate([rows for rows in matmuls if rows.shape[1] == weight.shape[1]])
        distances = ((weight[:, None, :] - rows[None]) ** 2).sum(-1)
        nearest, next_nearest = np.sort(distances, axis=1)[:, :2].T
        assert (nearest <= next_nearest / 4).all(), f"{name}: a row has no graph row clearly nearest to it"
        linear.weight.data = torch.from_numpy(rows[distances.argmin(1)].copy())
    return copied


def with_int8_activations(model: LlamaForCausalLM, block_size: int) -> LlamaForCausalLM:
    """A copy of `model` whose linear layers first round their input to int8, per block of `block_size` input
    features, symmetric (step = the block's largest magnitude / 127): how `MatMulNBits` at accuracy level 4 computes
    (ONNX Runtime), and OpenVINO's CPU plugin's dynamic quantization of a compressed-weight matmul's input."""

    def round_input(module, inputs):
        x = inputs[0]
        blocks = x.reshape(*x.shape[:-1], -1, block_size)
        step = blocks.abs().amax(-1, keepdim=True) / 127
        step = torch.where(step > 0, step, torch.ones_like(step))
        return (torch.round(blocks / step) * step).reshape(x.shape)

    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_input)
    return copied


@pytest.mark.parametrize("kind", ["paged", "stateful"])
@pytest.mark.parametrize("export", ["portable", "portable-int8", "portable-int4-float-compute"])
def test_openvino_batch_rows_join_and_leave_as_pytorch_computes_the_graphs_weights(
    export, kind, llama, exports, monkeypatch
):
    """The server's batches with `--engine openvino`, driven by hand in f32: the paged one it serves with
    (`PagedBatch`: every step in OpenVINO, each row's cache in blocks of its own) and the stateful one it falls back to
    (`OpenVinoBatch`: a quantized export's steps in ONNX Runtime at one row, an unquantized one's in OpenVINO; at a
    join OpenVINO's cache is read out, padded and written back). A row decodes alone, two prompts join mid-stream, the
    first row leaves. Every row's logits equal
    those of transformers' Llama with the graph's own weights (dequantized where quantized) over that row's tokens
    alone, within the error model below; its unquantized greedy tokens equal ONNX Runtime's `generate`.

    The int4 export asks for float32 compute (accuracy level 0). ONNX Runtime honours that; OpenVINO's CPU plugin
    rounds a compressed-weight matmul's input to int8 anyway unless told not to (its dynamic quantization,
    DYNAMIC_QUANTIZATION_GROUP_SIZE 0 turns it off), which it is told here: then both engines compute in float32 and
    the bound is the fp32 rule alone."""
    reference, _ = llama
    float_compute = export.endswith("float-compute")
    if float_compute:
        import openvino

        compile_model = openvino.Core.compile_model

        def without_int8_activations(core, graph, device=None, properties=None, *args, **kwargs):
            properties = {**(properties or {}), "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
            return compile_model(core, graph, device, properties, *args, **kwargs)

        monkeypatch.setattr(openvino.Core, "compile_model", without_int8_activations)
    model = OrtModelForCausalLM.from_pretrained(exports[export], engine="openvino", openvino_precision="f32")
    runtime = model.decoder_runtime
    step = runtime.step_model(kv_cache_dtype="float32") if kind == "paged" else OpenVinoStepModel(model, runtime)
    assert isinstance(step, PagedStepModel if kind == "paged" else OpenVinoStepModel)
    _, step_runs = CallCounter.both(model)
    batch = step.new_batch()
    generator = torch.Generator().manual_seed(5)
    lengths = {"a": 5, "b": 9, "c": 3}
    prompts = {name: torch.randint(3, 60, (length,), generator=generator).tolist() for name, length in lengths.items()}
    tokens = {name: [] for name in prompts}
    logits_seen = {name: [] for name in prompts}

    def choose(names: list[str], logits: np.ndarray) -> None:
        """The argmax with end-of-sequence held back, as generate's min_new_tokens holds it in the oracle."""
        logits = logits.copy()
        logits[:, model.config.eos_token_id] = -np.inf
        for name, row in zip(names, logits):
            tokens[name].append(int(row.argmax()))
            logits_seen[name].append(row)

    def decode(steps: int) -> None:
        for _ in range(steps):
            choose(batch.rows, batch.step(np.array([tokens[name][-1] for name in batch.rows])))

    first = step.prefill_group(["a"], [prompts["a"]])
    choose(["a"], first.run(first.columns))
    batch.join(first, [0])
    decode(3)
    group = step.prefill_group(["b", "c"], [prompts["b"], prompts["c"]])
    choose(group.rows, group.run(group.columns))
    batch.join(group, [0, 1])
    decode(4)
    batch.keep([1, 2])  # "a" leaves
    assert batch.rows == ["b", "c"]
    decode(12)
    manifest = load_manifest(exports[export])
    quantized = manifest.get("quantization") is not None
    # The stateful batch runs a's three steps alone in ONNX Runtime, where quantized; the paged one runs none there.
    assert step_runs.calls == (3 if quantized and kind == "stateful" else 0)
    # The oracle: PyTorch computing the graph's weights, no engine involved. The error model: both engines multiply
    # by those same weights in float32, so they differ from PyTorch by summation order, the exporter's fp32 rule
    # (relative per layer: its tolerance x the logits' largest magnitude x the depth). At accuracy level 4 (the
    # int8 export) a quantized matmul also rounds its input to int8 per block first (ONNX Runtime; OpenVINO's
    # dynamic quantization where its CPU plugin applies it), and which engine ran which of the row's positions
    # changes along the row. That rounding moves the logits by what `with_int8_activations` shows on the same tokens
    # (up to 6% of their largest magnitude in this chaotic random model), and two engines that both round do not
    # round alike: float32 noise of 1e-6 flips ties, a fresh draw of the same rounding. A draw's largest effect over
    # a row was at most 1.3x the emulated rounding's in 48 draws (every rounded input perturbed by a relative 1e-4
    # to flip ties; 6 token sequences of this model), so there the bound is the fp32 rule plus twice the emulated
    # rounding's effect. Unquantized, or quantized with float32 compute, the bound is the fp32 rule alone.
    oracle = with_graph_weights(reference, exports[export] / "model.onnx") if quantized else reference
    rounds = quantized and not float_compute
    rounding = with_int8_activations(oracle, manifest["quantization_options"]["block_size"]) if rounds else oracle
    kind, tolerance = TOLERANCES["fp32"]
    alone = OrtModelForCausalLM.from_pretrained(exports[export])
    for name, prompt in prompts.items():
        seen = np.stack(logits_seen[name])
        expected = teacher_forced_logits(oracle, prompt, tokens[name])
        rounded = teacher_forced_logits(rounding, prompt, tokens[name])
        for logits in (seen, expected, rounded):
            logits[:, model.config.eos_token_id] = 0.0
        scale = float(np.abs(expected).max())
        rounding_moves = float(np.abs(rounded - expected).max())
        allowed = allowed_difference(kind, tolerance, scale, reference.config.num_hidden_layers) + 2 * rounding_moves
        difference = float(np.abs(seen - expected).max())
        assert difference <= allowed, (name, difference, allowed)
        if not quantized:
            with torch.no_grad():
                count = len(tokens[name])
                output = alone.generate(
                    torch.tensor([prompt]), max_new_tokens=count, min_new_tokens=count, do_sample=False
                )
            assert tokens[name] == output[0, len(prompt) :].tolist(), name


def hub_cache_layout(folder: Path, root: Path) -> Path:
    """`folder` laid out as the Hugging Face Hub's cache stores a download: each file in blobs/ under a name of its
    own, and a snapshot folder of relative symlinks to them. Returns the snapshot folder."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "main"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(folder.iterdir())):
        (blobs / f"blob{index}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{index}"))
    return snapshot


def test_engine_openvino_reads_a_folder_laid_out_as_the_hub_cache(exports, tmp_path):
    """OpenVINO's ONNX reader refuses external data that resolves outside the graph's folder, which is every export
    downloaded from the Hub (its cache symlinks each file into blobs/): loading one failed with an error that blamed
    ONNX Runtime-only operators. Now it loads, leaves no file behind, and generates ONNX Runtime's tokens (f32)."""
    snapshot = hub_cache_layout(exports["portable"], tmp_path / "hub")
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(6))
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    model = OrtModelForCausalLM.from_pretrained(snapshot, engine="openvino", openvino_precision="f32")
    tokens = model.generate(ids, **options)
    assert sorted(path.name for path in (tmp_path / "hub" / "blobs").iterdir()) == sorted(
        f"blob{index}" for index in range(len(list(snapshot.iterdir())))
    )
    assert torch.equal(tokens, OrtModelForCausalLM.from_pretrained(exports["portable"]).generate(ids, **options))


def test_stateful_openvino_runs_a_decoder_without_position_ids(tmp_path):
    """An ALiBi decoder's graph takes no `position_ids`: the stateful loop fed them anyway and OpenVINO refused the
    step. Greedy tokens of a left-padded batch now equal ONNX Runtime's (f32)."""
    torch.manual_seed(0)
    source = tmp_path / "alibi"
    VaswaniForCausalLM(tiny_decoder_config(position_embedding_type="alibi")).eval().save_pretrained(source)
    folder = export_onnx(source, tmp_path / "alibi-onnx", task="text-generation", validate=False).folder
    ids, mask = left_padded([6, 3], 6, 60)
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    model = OrtModelForCausalLM.from_pretrained(folder, engine="openvino", openvino_precision="f32")
    assert "position_ids" not in model.graphs["model"].inputs
    tokens = model.generate(ids, **options)
    assert torch.equal(tokens, OrtModelForCausalLM.from_pretrained(folder).generate(ids, **options))


def test_the_decode_profiler_reads_openvinos_counters_for_each_call(exports, tmp_path):
    """`benchmarks/profile_decode.py --openvino`: each OpenVINO call of a generation is a run holding its executed
    nodes, so that a decode step splits into weight products (the CPU plugin's FullyConnected nodes), attention and
    the rest inside the call's time, and the loop between calls. The counters are off again afterwards. A single row
    of a small quantized export decodes in ONNX Runtime: the profiler says so and stops."""
    import openvino

    from benchmarks.profile_decode import generate_openvino, summarize

    folder = exports["portable-int8"]
    compile_model = openvino.Core.compile_model
    trace = Path(generate_openvino(folder, [[5, 6, 7, 8], [9, 10, 11, 12]], 6, 1, tmp_path))
    assert openvino.Core.compile_model is compile_model
    events = json.loads(trace.read_text())
    assert sum(event["name"] == "model_run" for event in events) == 6  # the prompt's call and 5 steps of 2 rows
    summary = summarize(trace, folder / "model.onnx", skip=1)
    assert summary["steps"] == 3 and summary["weight products"] > 0 and summary["attention"] > 0
    # Not the call's overhead: on a busy machine OpenVINO's node counters can add up to more than the call's time.
    assert summary["loop"] >= 0 and summary["GB/s"] > 0
    with pytest.raises(SystemExit, match="without --openvino"):
        generate_openvino(folder, [[5, 6, 7, 8]], 6, 1, tmp_path)


def test_openvino_warns_of_weights_whose_rows_are_not_whole_blocks(llama, exports, tmp_path, caplog):
    """A quantized export whose rows (K) are not a whole number of blocks loads with a warning that names the K, the
    block and the fix: OpenVINO's CPU plugin keeps such int8 weights as float32. The tiny Llama's rows are 64 and 128
    long: block 32 divides both (no warning), block 128 not the 64."""
    _, folder = llama
    with trace_onnx(folder, task="text-generation") as traced:
        partial = traced.export(
            tmp_path / "block128", validate=False, quantize=Quantization.of("int8", block_size=128),
            attention="portable",
        ).folder  # fmt: skip
    for export, warned in ((exports["portable-int8"], False), (partial, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vaswani.runtime.openvino"):
            OrtModelForCausalLM.from_pretrained(export, engine="openvino")
        messages = [record.getMessage() for record in caplog.records]
        messages = [message for message in messages if "whole number of blocks" in message]
        assert bool(messages) == warned, export
    assert "K=64 at block 128" in messages[0] and "--block-size" in messages[0]
