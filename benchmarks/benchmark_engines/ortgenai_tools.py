"""Perplexity of an onnxruntime-genai model folder (what its model builder writes); runs in the onnxruntime-genai
venv that benchmarks/benchmark_engines/setup.sh makes (benchmarks/engine_perplexity.py calls it).

    python ortgenai_tools.py perplexity FOLDER < windows.json    # {"windows": [[ids...], ...], "threads": 2}

The folder is scored through onnxruntime-genai's own runtime, not by running its model.onnx in a separate
onnxruntime session: `og.Model` / `og.Generator`, the objects that generate text, so the session options,
cache layout (past and present sharing one buffer of `max_length`) and attention path are the engine's. After
`append_tokens(window)`, `generator.get_output("logits")` is the graph's logits output for the whole prompt,
(1, window length, vocabulary), not only the last position that `get_logits()` and the search use; on a
40-token window of the fp32 build it is bit-identical to running the builder's model.onnx with
onnxruntime's InferenceSession on input_ids, an all-ones attention_mask and empty past_key_values.*.

Each window gets a fresh generator (an empty cache) with `max_length` equal to its length, the token ids come
from the driver (tokenized once there), and the loss is taken at every position but the first, as
benchmarks/real_model.py's `perplexity` does. onnxruntime-genai takes its thread count from genai_config.json's
session options, not from its Python API, so `threads` is overlaid on the folder's config at load time (the folder
is left as built).
"""

import json
import math
import sys

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, so that summing 511 losses per window loses nothing to rounding."""
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def perplexity(folder: str, windows: list[list[int]], threads: int) -> dict:
    """exp of the mean loss of onnxruntime-genai's model in `folder` over the windows, each from an empty cache.

    >>> perplexity("ortgenai-fp32", [[1, 2, 3, 4]], threads=2)  # doctest: +SKIP
    {'perplexity': ..., 'tokens': 3}
    """
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    total, count = 0.0, 0
    for ids in windows:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids), batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([ids], dtype=np.int32))
        logits = generator.get_output("logits")[0, :-1]
        if logits.shape[0] != len(ids) - 1:
            raise RuntimeError(f"onnxruntime-genai returned logits of shape {logits.shape} for {len(ids)} tokens")
        total -= log_softmax(logits)[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    return {"perplexity": math.exp(total / count), "tokens": count}


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "perplexity" and len(rest) == 1:
        request = json.loads(sys.stdin.read())
        print("RESULT " + json.dumps(perplexity(rest[0], request["windows"], request.get("threads", 2))))
    else:
        sys.exit(__doc__)
