"""A library changes no process-wide state behind its caller's back: the matplotlib backend, the umask, torch's thread
count, the classes of the models it exports."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_decoder_config

from vaswani import VaswaniForCausalLM
from vaswani.training import save_loss_curve

HISTORY = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "eval_loss": 2.7}]


def run_then_ask_a_new_thread(threads: list[threading.Thread]) -> int:
    """Start `threads` together and wait for them; then the torch thread count a thread started afterwards sees."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    later = []
    asking = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    asking.start()
    asking.join()
    return later[0]


def test_saving_a_loss_curve_leaves_matplotlib_as_the_caller_set_it(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    path = save_loss_curve(HISTORY, tmp_path / "loss.png")
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")
    # The examples' form: a chance line, a log axis and, since the evaluations carry an accuracy, a second panel.
    with_accuracy = [*HISTORY[:2], {"step": 2, "eval_loss": 2.7, "eval_accuracy": 0.6}]
    wide = save_loss_curve(with_accuracy, tmp_path / "wide.png", chance=1.1, log_scale=True, accuracy_target=0.99)
    png_width = lambda png: int.from_bytes(png.read_bytes()[16:20], "big")  # noqa: E731  (the IHDR chunk's width)
    assert png_width(wide) == png_width(path) * 10 // 7  # 10 inches for two panels, 7 for one
    assert matplotlib.get_backend() == backend
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot  # pyplot's global figure state was not used


def test_an_export_gets_the_processs_file_mode_without_touching_its_umask(tmp_path):
    pytest.importorskip("onnxruntime")
    from vaswani.export import export_onnx

    model = build_model(VaswaniForCausalLM, tiny_decoder_config())
    model.save_pretrained(tmp_path / "model")
    previous = os.umask(0o027)
    try:
        export_onnx(tmp_path / "model", tmp_path / "onnx", "text-generation", validate=False)
        assert os.umask(0o027) == 0o027  # unchanged by the export
    finally:
        os.umask(previous)
    files = [path for path in Path(tmp_path / "onnx").iterdir() if path.is_file()]
    assert files and {path.stat().st_mode & 0o777 for path in files} == {0o640}


def test_generate_in_two_threads_leaves_torch_threads_as_the_caller_set_them(tmp_path):
    """torch's intra-op thread count is the caller's: two threads generating at once (the second one started while
    the first is mid-generate, as a server's worker pool would) each keep their setting during and after, and a
    thread started meanwhile gets the process's setting, not one a generate() call left behind."""
    pytest.importorskip("onnxruntime")
    import threading

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from vaswani.export import export_onnx
    from vaswani.runtime import OrtModelForCausalLM

    model = build_model(VaswaniForCausalLM, tiny_decoder_config())
    model.save_pretrained(tmp_path / "model")
    export_onnx(tmp_path / "model", tmp_path / "onnx", "text-generation", validate=False)
    ort_model = OrtModelForCausalLM.from_pretrained(tmp_path / "onnx")
    first_inside, second_done = threading.Event(), threading.Event()
    seen: dict[str, list[int]] = {"first": [], "second": [], "started meanwhile": [], "after": []}

    class Record(LogitsProcessor):
        def __init__(self, name: str):
            self.name = name

        def __call__(self, input_ids, scores):
            seen[self.name].append(torch.get_num_threads())
            if self.name == "first" and not first_inside.is_set():
                first_inside.set()
                newcomer = threading.Thread(target=lambda: seen["started meanwhile"].append(torch.get_num_threads()))
                newcomer.start()
                newcomer.join()
                second_done.wait(timeout=60)  # the second generate runs and ends while this one is inside
            return scores

    def generate(name: str) -> None:
        ids = torch.tensor([[1, 5, 6, 7]])
        ort_model.generate(ids, max_new_tokens=3, do_sample=False, logits_processor=LogitsProcessorList([Record(name)]))
        seen["after"].append(torch.get_num_threads())

    def second() -> None:
        first_inside.wait(timeout=60)
        try:
            generate("second")
        finally:
            second_done.set()

    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        later = run_then_ask_a_new_thread(
            [threading.Thread(target=generate, args=("first",)), threading.Thread(target=second)]
        )
        assert seen == {"first": [3] * 3, "second": [3] * 3, "started meanwhile": [3], "after": [3, 3]}
        assert torch.get_num_threads() == 3 and later == 3
    finally:
        torch.set_num_threads(saved)


def test_export_formulations_leave_other_models_code_alone():
    """The export-only formulations apply to the model being exported, not to its classes: another model (another
    thread's export, with other formulations, or its forward) runs its own code meanwhile, with the same outputs."""
    pytest.importorskip("onnxruntime")
    import torch

    from vaswani.export.formulations import exporting_formulations
    from vaswani.modeling.layers import RMSNorm, VaswaniAttention

    exported = build_model(VaswaniForCausalLM, tiny_decoder_config(norm_type="rmsnorm"))
    other = build_model(VaswaniForCausalLM, tiny_decoder_config(norm_type="rmsnorm"), seed=1)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        before = other(ids).logits
        with exporting_formulations(exported, llm_ops=True):
            during = other(ids).logits
            others = [module for module in other.modules() if isinstance(module, RMSNorm | VaswaniAttention)]
            patched = [module for module in exported.modules() if isinstance(module, RMSNorm | VaswaniAttention)]
            assert others and all("forward" not in module.__dict__ for module in others)
            assert patched and all("forward" in module.__dict__ for module in patched)
    assert torch.equal(during, before)
    assert all("forward" not in module.__dict__ for module in patched)  # restored


def test_two_int4_exports_in_two_threads_both_validate_on_the_callers_torch_threads(tmp_path, monkeypatch):
    """int4's weight search runs on the torch threads its caller set (`vaswani export` sets one for itself): two
    exports at once, both inside the search together, see the caller's setting in every quantized matrix, both
    validate, and the caller's setting (and that of a thread started afterwards) is the same after."""
    pytest.importorskip("onnxruntime")
    import threading

    import torch

    from vaswani.export import export_onnx
    from vaswani.quantization import Quantization, int4

    search, seen, together = int4.search_quantize, [], threading.Barrier(2, timeout=120)

    def recording_search(*args, **kwargs):
        if threading.current_thread().name not in {name for name, _ in seen}:
            together.wait()  # the first matrix of each export: both exports are quantizing at this moment
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return search(*args, **kwargs)

    monkeypatch.setattr(int4, "search_quantize", recording_search)
    model = build_model(VaswaniForCausalLM, tiny_decoder_config(num_hidden_layers=1))
    model.save_pretrained(tmp_path / "model")
    results, errors = {}, []

    def export(name: str) -> None:
        try:
            options = dict(quantize=Quantization.of("int4", method="search", eight_bit_budget=0.0))
            results[name] = export_onnx(tmp_path / "model", tmp_path / name, "text-generation", **options)
        except BaseException as error:  # reported by the test below, not lost in the thread
            errors.append(error)

    saved = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        later = run_then_ask_a_new_thread(
            [threading.Thread(target=export, args=(name,), name=name) for name in ("first", "second")]
        )
        assert not errors, errors
        assert {name for name, _ in seen} == {"first", "second"} and {threads for _, threads in seen} == {3}
        assert all(result.validation.passed for result in results.values()) and len(results) == 2
        assert torch.get_num_threads() == 3 and later == 3
    finally:
        torch.set_num_threads(saved)
