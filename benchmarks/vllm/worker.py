"""One vLLM job in its own process, run by benchmarks/vllm_check.py with the Python of the vLLM venv.

    python benchmarks/vllm/worker.py JOB.json RESULT.json

JOB keys: model (folder), task (generate | embed | classify | throughput | load), remote_code (true: the folder's
own code, vaswani must NOT be importable; false: the installed vaswani through its vLLM plugin, no remote code),
prompts (lists of token ids), max_tokens, concurrency (for throughput), dtype, pooling (CLS | MEAN).
RESULT: the outputs (token ids, vectors, probabilities) or timings, and what vLLM was.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path


def build_llm(job: dict):
    from vllm import LLM

    vaswani_importable = importlib.util.find_spec("vaswani") is not None
    if job["remote_code"] and vaswani_importable:
        raise SystemExit("remote-code job, but vaswani is importable here: it would not test remote code")
    if not job["remote_code"] and not vaswani_importable:
        raise SystemExit("installed-package job, but vaswani is not importable here")
    kwargs = dict(
        model=job["model"],
        # Remote code needs the Transformers backend named; with the installed plugin the architecture is registered.
        model_impl="transformers" if job["remote_code"] else "auto",
        trust_remote_code=job["remote_code"],
        # Prompts come as token ids, tokenized once by the caller for both systems; the folder's tokenizer is
        # loaded anyway where there is one (vLLM's pooling front end needs it).
        skip_tokenizer_init=not (Path(job["model"]) / "tokenizer.json").exists(),
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len"),  # None: the config's max_position_embeddings
        max_num_seqs=job.get("max_num_seqs", 32),
        enforce_eager=job.get("enforce_eager", True),
        seed=0,
    )
    if job["task"] in ("embed", "classify"):
        from vllm.config import PoolerConfig

        kwargs["runner"] = "pooling"
        kwargs["pooler_config"] = PoolerConfig(seq_pooling_type=job.get("pooling", "CLS"))
    return LLM(**kwargs)


def run(job: dict) -> dict:
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = build_llm(job)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job.get("prompts", [])]
    result = {"vllm": vllm.__version__, "torch": torch.__version__}
    greedy = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0.0, ignore_eos=True, detokenize=False)
    if job["task"] == "generate":
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
    elif job["task"] == "embed":
        result["vectors"] = [output.outputs.embedding for output in llm.embed(prompts, use_tqdm=False)]
    elif job["task"] == "classify":
        result["probs"] = [output.outputs.probs for output in llm.classify(prompts, use_tqdm=False)]
    elif job["task"] == "throughput":
        llm.generate(prompts[:2], greedy, use_tqdm=False)  # warm-up
        rounds = []
        for concurrency in job["concurrency"]:
            batch = [prompts[i % len(prompts)] for i in range(concurrency)]
            start = time.perf_counter()
            outputs = llm.generate(batch, greedy, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            rounds.append({"concurrency": concurrency, "tokens": tokens, "seconds": seconds})
        result["rounds"] = rounds
    return result


if __name__ == "__main__":  # vLLM starts its engine with spawn: the job runs only in the main process
    job = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as handle:
        json.dump(run(job), handle)
