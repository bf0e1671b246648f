"""The import paths of the ONNX exporter and runtime before they moved out of `vaswani.conversion`: each still hands on
the very object of its new home, with one FutureWarning naming that home, and an unknown name is an AttributeError."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest

pytest.importorskip("onnxruntime")

import vaswani.export  # noqa: E402
import vaswani.runtime  # noqa: E402

MOVED = [
    ("vaswani.conversion", "export_onnx", vaswani.export),
    ("vaswani.conversion", "OrtModelForCausalLM", vaswani.runtime),
    ("vaswani.conversion", "load_manifest", vaswani.runtime),
    ("vaswani.conversion.onnx", "validate_onnx_export", vaswani.export),
    ("vaswani.conversion.onnx", "default_session_options", vaswani.runtime),
    ("vaswani.conversion.onnx", "OrtModelForSeq2SeqLM", vaswani.runtime),
]


def test_an_old_path_hands_on_the_new_object_and_warns_once_naming_its_home():
    # A fresh process: the warning comes once per name, so this process may have spent it already.
    code = "import json, warnings\nwarnings.simplefilter('always')\nfound = {}\n"
    for module, name, home in MOVED:
        code += (
            "with warnings.catch_warnings(record=True) as caught:\n"
            f"    from {module} import {name} as first\n"
            f"    from {module} import {name} as second\n"
            f"import {home.__name__}\n"
            f"found['{module}.{name}'] = [first is second is {home.__name__}.{name}, "
            "[str(w.message) for w in caught if issubclass(w.category, FutureWarning)]]\n"
        )
    code += "print(json.dumps(found))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    for module, name, home in MOVED:
        same, messages = found[f"{module}.{name}"]
        assert same, f"{module}.{name} is not {home.__name__}.{name}"
        assert len(messages) == 1 and f"from {home.__name__} import {name}" in messages[0], messages


def test_checkpoint_names_stay_at_home_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from vaswani.conversion import convert_checkpoint, from_transformers, to_transformers  # noqa: F401


@pytest.mark.parametrize("module", ["vaswani.conversion", "vaswani.conversion.onnx"])
def test_an_unknown_name_is_an_attribute_error(module):
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = importlib.import_module(module).no_such_name
