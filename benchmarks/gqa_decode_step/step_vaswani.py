"""Per-step decode time of one GQA-form export: python step.py FOLDER THREADS BATCH STEPS -> json line."""

import json
import sys
import time

import numpy as np
import onnxruntime as ort
import torch

from vaswani.runtime import default_session_options
from vaswani.runtime.gqa import GqaDecoder

folder, threads, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
options = default_session_options(threads)
session = ort.InferenceSession(f"{folder}/model.onnx", options, providers=["CPUExecutionProvider"])
manifest = json.load(open(f"{folder}/manifest.json"))
decoder = GqaDecoder(session, manifest, 8192)
prompt = torch.tensor([[1, 33, 30, 1903, 9801, 2437, 284, 19484, 5811, 3834, 828, 198, 34, 30, 1903, 9801]] * batch)
logits, state = decoder.start(prompt, None, 16 + steps + 8)
tokens = logits.argmax(-1)
out, wall, cpu = [], [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time()
    logits = decoder.decode(state, tokens)
    tokens = torch.from_numpy(logits.numpy().argmax(-1))  # genai's step picks its token too (numpy: as the lean loop)
    wall.append(time.perf_counter() - w)
    cpu.append(time.process_time() - c)
    out.append(int(tokens[0]))
skip = 4
print(
    json.dumps(
        {"wall_ms": 1000 * float(np.median(wall[skip:])), "cpu_ms": 1000 * float(np.median(cpu[skip:])), "tokens": out}
    )
)
