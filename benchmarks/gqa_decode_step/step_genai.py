"""Per-step decode time of onnxruntime-genai: python genai_step.py FOLDER THREADS BATCH STEPS -> json line."""

import json
import os
import sys
import time

import numpy as np
import onnxruntime_genai as og

src, threads, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
folder = f"{os.environ.get('WORK', '/tmp/gqa2')}/genai-{os.path.basename(src)}-t{threads}"
if not os.path.isdir(folder):
    os.makedirs(folder)
    for name in os.listdir(src):
        if name != "genai_config.json":
            os.symlink(f"{src}/{name}", f"{folder}/{name}")
    config = json.load(open(f"{src}/genai_config.json"))
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    json.dump(config, open(f"{folder}/genai_config.json", "w"))
model = og.Model(folder)
prompt = [[1, 33, 30, 1903, 9801, 2437, 284, 19484, 5811, 3834, 828, 198, 34, 30, 1903, 9801]] * batch
params = og.GeneratorParams(model)
length = 16 + steps + 1
params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=batch)
generator = og.Generator(model, params)
generator.append_tokens(np.array(prompt, dtype=np.int32))  # prefill + first token
wall, cpu = [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time()
    generator.generate_next_token()
    wall.append(time.perf_counter() - w)
    cpu.append(time.process_time() - c)
out = list(map(int, generator.get_sequence(0)))[17:]
skip = 4
print(
    json.dumps(
        {"wall_ms": 1000 * float(np.median(wall[skip:])), "cpu_ms": 1000 * float(np.median(cpu[skip:])), "tokens": out}
    )
)
