"""Weight-only quantization of exported graphs: one `Quantization` object per export, chosen from a registry of
schemes (`SCHEMES`: int8 and int4, `schemes.py`), each with its options, its graph pass and its validation bounds.

Where things are:

- `scheme.py`: `Quantization`, `QuantizationScheme`, the registry and the `vaswani export` flags it declares.
- `schemes.py`: the int8 and int4 entries and the bounds measured for them.
- `matmul_nbits.py`: their graph pass (every weight MatMul to ONNX Runtime's `MatMulNBits`); `fusions.py`.
- `int4.py` (search, GPTQ), `sensitivity.py` (which matrices keep 8 bits), `graph_weights.py` (weights read one at a
  time), `matmul_check.py` (each quantized matrix judged alone).

Example:
    >>> from vaswani.quantization import Quantization
    >>> Quantization.of("int4", method="rtn").block_size
    32
"""

from .scheme import (
    OPTIONS,
    SCHEMES,
    Quantization,
    QuantizationOption,
    QuantizationScheme,
    QuantizedBounds,
    add_quantization_arguments,
    as_quantization,
    register_scheme,
    scheme_named,
)
from .schemes import DEFAULT_EIGHT_BIT_BUDGET, MATMUL_BOUNDS

__all__ = [
    "DEFAULT_EIGHT_BIT_BUDGET",
    "MATMUL_BOUNDS",
    "OPTIONS",
    "SCHEMES",
    "Quantization",
    "QuantizationOption",
    "QuantizationScheme",
    "QuantizedBounds",
    "add_quantization_arguments",
    "as_quantization",
    "register_scheme",
    "scheme_named",
]
