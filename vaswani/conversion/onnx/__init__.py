"""The old home of the ONNX exporter and runtime, kept so that existing imports run: each name warns once
(`FutureWarning`) and names its new home, `vaswani.export` (the exporter and validation) or `vaswani.runtime` (the
ONNX Runtime models)."""

from .. import _MOVED_NAMES, moved_name

_HOMES = {**_MOVED_NAMES, "OrtModel": "vaswani.runtime", "OrtModelForGeneration": "vaswani.runtime"}
_HOMES["default_session_options"] = "vaswani.runtime"


def __getattr__(name: str):
    value = moved_name(__name__, name, _HOMES)
    globals()[name] = value  # warned once: later lookups find it here
    return value
