"""Steady per-token time of a whole greedy generate: (t(72 new) - t(8 new)) / 64, wall and CPU, median of 3.
python e2e.py vaswani|genai FOLDER THREADS BATCH"""

import json
import os
import statistics
import sys
import time

import numpy as np

kind, folder, threads, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompt = [[1, 33, 30, 1903, 9801, 2437, 284, 19484, 5811, 3834, 828, 198, 34, 30, 1903, 9801]] * batch
if kind == "genai":
    import onnxruntime_genai as og

    sys.argv[2] = folder
    src = folder
    folder = f"{os.environ.get('WORK', '/tmp/gqa2')}/genai-{os.path.basename(src)}-t{threads}"  # made by genai_step.py
    model = og.Model(folder)

    def gen(n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=16 + n, min_length=16 + n, do_sample=False, batch_size=batch)
        g = og.Generator(model, params)
        g.append_tokens(np.array(prompt, dtype=np.int32))
        while not g.is_done():
            g.generate_next_token()
        return list(map(int, g.get_sequence(0)))[16:]
else:
    import torch

    from vaswani.runtime import OrtModelForCausalLM, default_session_options

    torch.set_num_threads(threads)
    m = OrtModelForCausalLM.from_pretrained(folder, session_options=default_session_options(threads))
    ids = torch.tensor(prompt)

    def gen(n):
        out = m.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, 16:].tolist()


gen(4)
walls, cpus = [], []
for _ in range(3):
    w, c = time.perf_counter(), time.process_time()
    gen(8)
    w8, c8 = time.perf_counter() - w, time.process_time() - c
    w, c = time.perf_counter(), time.process_time()
    tokens = gen(72)
    w72, c72 = time.perf_counter() - w, time.process_time() - c
    walls.append((w72 - w8) / 64)
    cpus.append((c72 - c8) / 64)
print(
    json.dumps(
        {"wall_ms": 1000 * statistics.median(walls), "cpu_ms": 1000 * statistics.median(cpus), "tokens": tokens[:40]}
    )
)
