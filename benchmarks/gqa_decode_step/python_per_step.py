"""Python time per step of the lean loop outside the graph runs: python python_per_step.py EXPORT [BATCH]."""

import statistics
import sys
import time

import onnxruntime as ort
import torch

from vaswani.runtime import OrtModelForCausalLM, default_session_options

torch.set_num_threads(1)
m = OrtModelForCausalLM.from_pretrained(sys.argv[1], session_options=default_session_options(1))
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
ids = torch.tensor([[1, 33, 30, 1903, 9801, 2437, 284, 19484, 5811, 3834, 828, 198, 34, 30, 1903, 9801]] * batch)
run = ort.InferenceSession.run_with_iobinding
t_run = [0.0]


def timed(self, *a, **k):
    t = time.perf_counter()
    r = run(self, *a, **k)
    t_run[0] += time.perf_counter() - t
    return r


ort.InferenceSession.run_with_iobinding = timed


def go(n):
    t_run[0] = 0.0
    t = time.perf_counter()
    m.generate(
        ids,
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None if len(sys.argv) > 3 else m.generation_config.eos_token_id,
    )
    return time.perf_counter() - t - t_run[0]


go(4)
rows = []
for _ in range(5):
    a, b = go(8), go(72)
    rows.append((b - a) / 64)
print(
    f"python per step (steady, excluding session runs): median {1e3 * statistics.median(rows):.4f} ms; fixed per generate {1e3 * a:.1f} ms"
)
