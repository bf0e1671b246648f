"""One ONNX Runtime `MatMulNBits` node alone, per weight layout: how long a decode step's product takes for each of
SmolLM2-135M's weight shapes with 4-bit weights with or without zero points (ours are asymmetric, onnxruntime-genai's
symmetric) and with 8-bit symmetric weights, at int8 compute (accuracy level 4, the exports' default) or float32
compute (level 1). Random weights: the kernels' speed does not depend on the values.

    python -m benchmarks.profile_matmul_nbits                   # batch 1, 2 threads, the SmolLM2 shapes
    python -m benchmarks.profile_matmul_nbits --rows 8 --accuracy-levels 4

The weights of one node are a few MB and mostly stay in the CPU's caches, so these are kernel (compute) times; in a
whole decode step the weights stream from memory. Each layout runs in a session of its own, one session alive at a
time, 50 warm-up runs, then the best of `--rounds` rounds of `--runs` back-to-back runs, in microseconds.
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# (K, N) of SmolLM2-135M's products: fused q/k/v, o, fused gate/up, down, the tied LM head.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
LAYOUTS = {"4-bit, zero points": (4, True), "4-bit, symmetric": (4, False), "8-bit, symmetric": (8, False)}


def matmul_nbits_model(k: int, n: int, bits: int, zero_points: bool, accuracy_level: int, rows: int) -> bytes:
    """A graph of one MatMulNBits node, [rows, K] x [K, N], blocks of 32, random packed weights."""
    rng = np.random.default_rng(0)
    blocks = k // 32
    initializers = [
        numpy_helper.from_array(rng.integers(0, 256, (n, blocks, 32 * bits // 8), dtype=np.uint8), "weight"),
        numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), "scales"),
    ]
    if zero_points:
        initializers.append(
            numpy_helper.from_array(rng.integers(0, 256, n * ((blocks * bits + 7) // 8), np.uint8), "zp")
        )
    node = helper.make_node(
        "MatMulNBits",
        ["x", "weight", "scales", *(["zp"] if zero_points else [])],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=32,
        accuracy_level=accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "matmul_nbits",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def timed_runs(session: ort.InferenceSession, feed: dict, runs: int) -> float:
    """Mean microseconds of `runs` back-to-back runs."""
    start = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    return (time.perf_counter() - start) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (the batch, at a decode step)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--accuracy-levels", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    print(f"| K x N | accuracy level | {' | '.join(LAYOUTS)} |")
    print("|---|---|" + "---|" * len(LAYOUTS))
    for k, n in SHAPES:
        for level in args.accuracy_levels:
            feed = {"x": np.random.default_rng(1).random((args.rows, k), dtype=np.float32)}
            best = {}
            for name, (bits, zero_points) in LAYOUTS.items():
                # One session alive at a time: an idle session's intra-op threads spin and would take the cores.
                model = matmul_nbits_model(k, n, bits, zero_points, level, args.rows)
                session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
                for _ in range(50):
                    session.run(None, feed)
                best[name] = min(timed_runs(session, feed, args.runs) for _ in range(args.rounds))
                del session
            print(f"| {k} x {n} | {level} | " + " | ".join(f"{best[name]:.1f}" for name in LAYOUTS) + " |")


if __name__ == "__main__":
    main()
