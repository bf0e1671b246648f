"""A library changes no process-wide state behind its caller's back: the matplotlib backend, the umask."""

import os
import sys
from pathlib import Path

import pytest
from conftest import build_model, tiny_decoder_config

from vaswani import VaswaniForCausalLM
from vaswani.training import save_loss_curve

HISTORY = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "eval_loss": 2.7}]


def test_saving_a_loss_curve_leaves_matplotlib_as_the_caller_set_it(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    path = save_loss_curve(HISTORY, tmp_path / "loss.png")
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")
    assert matplotlib.get_backend() == backend
    assert ("matplotlib.pyplot" in sys.modules) == had_pyplot  # pyplot's global figure state was not used


def test_an_export_gets_the_processs_file_mode_without_touching_its_umask(tmp_path):
    pytest.importorskip("onnxruntime")
    from vaswani.conversion.onnx import export_onnx

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
