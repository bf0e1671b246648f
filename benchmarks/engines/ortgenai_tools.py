"""Perplexity of an onnxruntime-genai model folder (what its model builder writes); runs in the onnxruntime-genai
venv that benchmarks/engines/setup.sh makes (benchmarks/engine_perplexity.py calls it).

    python ortgenai_tools.py perplexity FOLDER < windows.json    # {"windows": [{"ids": [...], "scored_from": 1}], "threads": 2}

The folder is scored through onnxruntime-genai's own runtime, not by running its model.onnx in a separate
onnxruntime session: `og.Model` / `og.Generator`, the objects that generate text, so the session options,
cache layout (past and present sharing one buffer of `max_length`) and attention path are the engine's. After
`append_tokens(window)`, `generator.get_output("logits")` is the graph's logits output for the whole prompt,
(1, window length, vocabulary), not only the last position that `get_logits()` and the search use; on a
40-token window of the fp32 build it is bit-identical to running the builder's model.onnx with
onnxruntime's InferenceSession on input_ids, an all-ones attention_mask and empty past_key_values.*.

Each window gets a fresh generator (an empty cache) with `max_length` equal to its length, the token ids come
from the driver (tokenized once there), and its tokens from `scored_from` on are scored
(windows.py), as `vaswani perplexity` scores them. onnxruntime-genai takes its thread count from genai_config.json's
session options, not from its Python API, so `threads` is overlaid on the folder's config at load time (the folder
is left as built).
"""

import json
import sys

import numpy as np
from windows import Total, request_windows


def perplexity(folder: str, windows: list[tuple[list[int], int]], threads: int) -> dict:
    """exp of the mean loss of onnxruntime-genai's model in `folder` over the windows, each from an empty cache.

    >>> perplexity("ortgenai-fp32", [([1, 2, 3, 4], 1)], threads=2)  # doctest: +SKIP
    {'perplexity': ..., 'mean_nll': ..., 'tokens': 3}
    """
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    total = Total()
    for ids, scored_from in windows:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids), batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([ids], dtype=np.int32))
        total.add(generator.get_output("logits")[0, :-1], ids, scored_from)
    return total.result()


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["help"]
    if command == "perplexity" and len(rest) == 1:
        request = json.loads(sys.stdin.read())
        print("RESULT " + json.dumps(perplexity(rest[0], request_windows(request), request.get("threads", 2))))
    else:
        sys.exit(__doc__)
