"""ONNX Runtime against vaswani's PyTorch `generate`, side by side in one process, at the reference shapes.

Workload (../shared/REFERENCE.md): batch 1, a random 32-token prompt, 128 new tokens greedy (`min_new_tokens=128`),
2 CPU threads for both, median of 3 runs after a warm-up, run alternately so machine drift hits both equally. ONNX
Runtime's thread spinning is turned off (it took the cores from the PyTorch runs in the same process and inflated
the ratios this script once reported); benchmarks/benchmark_engines.py times each system in a process of its own and
compares against other engines.

    python -m benchmarks.benchmark_onnx                        # decoder, seq2seq and int8 sections (CPU), about 10 min
    python -m benchmarks.benchmark_onnx --quick                # 16 new tokens, 1 run: checks that everything works
    python -m benchmarks.benchmark_onnx --sections int8 --markdown onnx.md
    python -m benchmarks.benchmark_onnx --sections gpu         # fp16 ORT CUDA vs PyTorch CUDA (needs a GPU)

Sections:
- decoder: LLaMA-shaped decoder (21.8M parameters), fp32, random weights (seed 0). Bar: ORT >= 2.5x PyTorch.
- seq2seq: BART-shaped encoder-decoder (49.3M), fp32. Bar: ORT >= 2.5x PyTorch.
- int8: the LLaMA-shaped decoder quantized to int8 (speed; bar: >= 5x PyTorch fp32), and its quality on a TRAINED
  model, the demo's (examples/demo.py; `--demo-model`, trained here with `--train-demo` if missing): held-out
  perplexity of PyTorch fp32, ORT fp32 and ORT int8 (bar: int8 within 2% of fp32) on the demo's held-out stories,
  and the greedy token agreement of int8 with fp32.
- gpu: fp16 ORT on CUDA vs PyTorch on CUDA (bf16 and fp16, static cache, compiled) at batch 1 and 16; the batch-1
  decode step time against its bound, weight bytes / memory bandwidth.

Exports are kept in `--work-dir` and reused by later runs (the weights are seeded); `--fresh` exports again.
"""

import argparse
import copy
import importlib.util
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

import vaswani  # noqa: F401  (registers the vaswani models with the Auto classes)
from benchmarks.benchmark import BART_SHAPE, LLAMA_SHAPE, VOCAB, time_alternating
from vaswani.conversion.checkpoints import from_transformers
from vaswani.evaluation.perplexity import summed_nll
from vaswani.evaluation.speed import memory_bandwidth
from vaswani.export import export_onnx
from vaswani.runtime import OrtModelForCausalLM, OrtModelForGeneration, OrtModelForSeq2SeqLM, default_session_options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SECTIONS = ("decoder", "seq2seq", "int8", "gpu")
BARS = {"decoder": 2.5, "seq2seq": 2.5, "int8": 5.0}


def reference_models() -> dict[str, PreTrainedModel]:
    """The reference shapes as vaswani models with seeded random weights (converted from transformers' Llama and
    BART, as benchmarks/benchmark.py builds them)."""
    torch.manual_seed(0)
    decoder = from_transformers(LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE)).eval())
    torch.manual_seed(0)
    seq2seq = from_transformers(BartForConditionalGeneration(BartConfig(**BART_SHAPE)).eval())
    return {"decoder": decoder.eval(), "seq2seq": seq2seq.eval()}


def exported(model: PreTrainedModel, folder: Path, args: argparse.Namespace, **options) -> Path:
    """`model` exported into `folder`, unless an earlier run left it there."""
    if args.fresh or not (folder / "manifest.json").is_file():
        print(f"  exporting to {folder} {options or ''}...", flush=True)
        start = time.perf_counter()
        export_onnx(model, folder, overwrite=True, **options)
        print(f"  exported in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def load(ort_class, folder: Path, args: argparse.Namespace, **kwargs) -> OrtModelForGeneration:
    options = default_session_options(args.threads)
    # ONNX Runtime's intra-op threads spin after each run and, in this one process, take the cores from the PyTorch
    # run that follows: PyTorch once measured 53 tok/s here and 72-90 in a process of its own, inflating the ratio.
    # Without spinning the comparison is fair (ORT itself is then a little slower than in a process of its own;
    # benchmarks/benchmark_engines.py times each system in its own process instead).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort_class.from_pretrained(folder, session_options=options, **kwargs)


def generation_task(model, prompt: torch.Tensor, new_tokens: int, outputs: dict, name: str, **kwargs):
    def run() -> None:
        with torch.no_grad():
            outputs[name] = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                **kwargs,
            )

    return run


def lean(model: OrtModelForGeneration, fast: bool) -> OrtModelForGeneration:
    model.fast_generation = fast
    return model


# ---------------------------------------------------------------------------------------------------- speed


def speed_rows(
    label: str, pytorch_model: PreTrainedModel, contenders: dict, args: argparse.Namespace, device: str = "cpu"
) -> list[str]:
    """Time PyTorch and each ORT contender on the workload; one markdown row per contender."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, VOCAB, (args.batch, args.prompt), generator=generator).to(device)
    outputs: dict[str, torch.Tensor] = {}
    tasks = {"pytorch": generation_task(pytorch_model, prompt, args.new_tokens, outputs, "pytorch", **args.extra)}
    for name, (model, fast) in contenders.items():
        tasks[name] = generation_task(lean(model, fast), prompt, args.new_tokens, outputs, name)
    medians = time_alternating(tasks, args.repeats, device)
    tokens = args.batch * args.new_tokens
    baseline = tokens / medians["pytorch"]
    rows = [f"| {label}: vaswani PyTorch `generate` ({args.attn}) | {baseline:.1f} | 1.00 | |"]
    for name in contenders:
        rate = tokens / medians[name]
        same = "yes" if torch.equal(outputs[name].cpu(), outputs["pytorch"].cpu()) else "no"
        rows.append(f"| {label}: {name} | {rate:.1f} | **{rate / baseline:.2f}** | {same} |")
    for row in rows:
        print("  " + row, flush=True)
    return rows


TABLE_HEADER = "| system | tokens/s | x PyTorch | same tokens as PyTorch |\n|---|---|---|---|"


def bench_decoder(models: dict, args: argparse.Namespace) -> str:
    model = models["decoder"]
    folder = exported(model, args.work_dir / "llama-fp32", args, task="text-generation")
    ort_model = load(OrtModelForCausalLM, folder, args)
    contenders = {"ORT fp32, lean loop": (ort_model, True), "ORT fp32, transformers' loop": (ort_model, False)}
    if args.optimize:
        folder = exported(model, args.work_dir / "llama-fp32-opt", args, task="text-generation", optimize=True)
        contenders["ORT fp32 optimized, lean loop"] = (load(OrtModelForCausalLM, folder, args), True)
    rows = speed_rows("LLaMA-shaped", model, contenders, args)
    return "\n".join([f"**LLaMA-shaped decoder, fp32** (bar: ORT >= {BARS['decoder']}x)", "", TABLE_HEADER, *rows])


def bench_seq2seq(models: dict, args: argparse.Namespace) -> str:
    model = models["seq2seq"]
    folder = exported(model, args.work_dir / "bart-fp32", args, task="text2text-generation")
    ort_model = load(OrtModelForSeq2SeqLM, folder, args)
    contenders = {"ORT fp32, lean loop": (ort_model, True), "ORT fp32, transformers' loop": (ort_model, False)}
    rows = speed_rows("BART-shaped", model, contenders, args)
    return "\n".join(
        [f"**BART-shaped encoder-decoder, fp32** (bar: ORT >= {BARS['seq2seq']}x)", "", TABLE_HEADER, *rows]
    )


# --------------------------------------------------------------------------------------------- int8 quality


def demo_model(args: argparse.Namespace) -> Path:
    """The demo's trained model folder; with --train-demo, examples/demo.py trains it first (its default one-minute
    budget) if it is missing."""
    if (args.demo_model / "config.json").is_file():
        return args.demo_model
    if not args.train_demo:
        raise SystemExit(
            f"No trained model in {args.demo_model}: run `python examples/demo.py` first (about a minute), or pass "
            f"--train-demo to train it here, or --demo-model <folder>."
        )
    command = [sys.executable, str(EXAMPLES / "demo.py"), "--output", str(args.demo_model)]
    print(f"  training the demo model: {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    return args.demo_model


def demo_script() -> ModuleType:
    """examples/demo.py as a module (the examples are scripts, not a package), for its split and encoding."""
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    sys.modules["demo"] = demo  # its dataclasses look their module up by name
    spec.loader.exec_module(demo)
    return demo


def heldout_windows(tokenizer, block_size: int, limit: int | None) -> torch.Tensor:
    """The demo's held-out token stream (the stories neither its tokenizer nor its model saw), in consecutive
    windows of `block_size` tokens, as the demo evaluates it."""
    retrained, _, heldout = demo_script().load_data(len(tokenizer))
    if retrained.get_vocab() != tokenizer.get_vocab():
        raise SystemExit("The demo model's tokenizer differs from the one examples/demo.py trains; retrain the demo.")
    windows = heldout[: len(heldout) // block_size * block_size].view(-1, block_size)
    return windows[:limit]


def mean_next_token_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token NLL over the consecutive windows (`vaswani perplexity` with context = stride = their
    length), `batch_size` windows per forward."""
    length = windows.shape[1]
    total, count = summed_nll(model, windows, "text-generation", length, length, batch_tokens=batch_size * length)
    return total / count


def greedy_agreement(reference, candidate, prompts: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Fraction of generated positions where `candidate` picks `reference`'s token, and the mean number of tokens
    generated before the first difference."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    same = torch.stack(
        [
            reference.generate(prompt[None], **kwargs)[0, prompts.shape[1] :]
            == candidate.generate(prompt[None], **kwargs)[0, prompts.shape[1] :]
            for prompt in prompts
        ]
    )
    before_first_difference = (same.cumprod(dim=1).sum(dim=1)).float().mean().item()
    return same.float().mean().item(), before_first_difference


def bench_int8(models: dict, args: argparse.Namespace) -> str:
    model = models["decoder"]
    fp32 = load(OrtModelForCausalLM, exported(model, args.work_dir / "llama-fp32", args, task="text-generation"), args)
    folder = exported(model, args.work_dir / "llama-int8", args, task="text-generation", quantize="int8")
    int8 = load(OrtModelForCausalLM, folder, args)
    rows = speed_rows(
        "LLaMA-shaped", model, {"ORT fp32, lean loop": (fp32, True), "ORT int8, lean loop": (int8, True)}, args
    )
    speed = "\n".join(
        [
            f"**LLaMA-shaped decoder, int8 speed** (bar: int8 ORT >= {BARS['int8']}x PyTorch fp32)",
            "",
            TABLE_HEADER,
            *rows,
        ]
    )

    source = demo_model(args)
    tokenizer = AutoTokenizer.from_pretrained(source)
    pytorch_model = AutoModelForCausalLM.from_pretrained(source).eval()
    block_size = pytorch_model.config.max_position_embeddings
    demo_fp32 = load(
        OrtModelForCausalLM, exported(source, args.work_dir / "demo-fp32", args, task="text-generation"), args
    )
    demo_int8 = load(
        OrtModelForCausalLM,
        exported(source, args.work_dir / "demo-int8", args, task="text-generation", quantize="int8"),
        args,
    )
    windows = heldout_windows(tokenizer, block_size, 16 if args.quick else None)
    print(f"  held-out perplexity on {windows.numel():,} tokens...", flush=True)
    with torch.no_grad():
        losses = {
            "PyTorch fp32": mean_next_token_loss(pytorch_model, windows),
            "ORT fp32": mean_next_token_loss(demo_fp32, windows),
            "ORT int8": mean_next_token_loss(demo_int8, windows),
        }
    prompts = windows[: 4 if args.quick else 32, :16]
    agreement, run_length = greedy_agreement(demo_fp32, demo_int8, prompts, 16 if args.quick else 64)
    reference = math.exp(losses["ORT fp32"])
    lines = [
        f"**int8 quality on the trained demo model** ({source}; {windows.numel():,} held-out tokens; bar: int8 "
        f"perplexity within 2% of fp32)",
        "",
        "| model | held-out perplexity | vs ORT fp32 |",
        "|---|---|---|",
        *(
            f"| {name} | {math.exp(loss):.3f} | {math.exp(loss) / reference - 1:+.2%} |"
            for name, loss in losses.items()
        ),
        "",
        f"Greedy agreement, ORT int8 vs ORT fp32, {len(prompts)} held-out prompts of 16 tokens: {agreement:.1%} of "
        f"generated tokens equal; {run_length:.1f} tokens on average before the first difference.",
    ]
    for line in lines:
        print("  " + line, flush=True)
    return speed + "\n\n" + "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ GPU


def bench_gpu(models: dict, args: argparse.Namespace) -> str:
    if not torch.cuda.is_available():
        return "**GPU**: skipped, no CUDA device."
    model = models["decoder"]
    folder = exported(
        model, args.work_dir / "llama-fp16-cuda", args, task="text-generation", dtype="fp16", device="cuda"
    )
    ort_model = OrtModelForCausalLM.from_pretrained(folder, provider="cuda")
    lines = [
        "**LLaMA-shaped decoder on the GPU** (ORT fp16 CUDA with IO binding vs PyTorch CUDA, static cache)",
        "",
        TABLE_HEADER,
    ]
    saved = args.batch, args.extra
    for batch in (1, 16):
        args.batch = batch
        for dtype in (torch.bfloat16, torch.float16):
            pytorch_model = copy.deepcopy(model).to("cuda", dtype)
            args.extra = {"cache_implementation": "static"}
            label = f"batch {batch}, PyTorch {str(dtype).split('.')[-1]}"
            lines += speed_rows(label, pytorch_model, {"ORT fp16 CUDA, lean loop": (ort_model, True)}, args, "cuda")
    args.batch, args.extra = saved

    # Batch-1 decode step: time 1 and 1 + n new tokens; the difference is n decode steps.
    prompt = torch.randint(3, VOCAB, (1, args.prompt), device="cuda")
    times = {}
    for new_tokens in (1, 1 + args.new_tokens):
        outputs: dict = {}
        task = generation_task(lean(ort_model, True), prompt, new_tokens, outputs, "ort")
        times[new_tokens] = time_alternating({"ort": task}, args.repeats, "cuda")["ort"]
    step = (times[1 + args.new_tokens] - times[1]) / args.new_tokens
    weight_bytes = sum(p.numel() for p in model.parameters()) * 2  # fp16
    bandwidth = memory_bandwidth("cuda", 1024, rounds=10, summary=statistics.median)
    bound = weight_bytes / bandwidth
    lines += [
        "",
        f"Batch-1 decode step, ORT fp16 CUDA: {step * 1e3:.3f} ms; bound = {weight_bytes / 1e6:.1f} MB of fp16 "
        f"weights / {bandwidth / 1e9:.0f} GB/s (measured copy bandwidth) = {bound * 1e3:.3f} ms "
        f"(the step runs at {bound / step:.0%} of the bandwidth bound).",
    ]
    return "\n".join(lines)


BENCHES = {"decoder": bench_decoder, "seq2seq": bench_seq2seq, "int8": bench_int8, "gpu": bench_gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="decoder,seq2seq,int8", help=f"comma-separated, from {SECTIONS}")
    parser.add_argument("--quick", action="store_true", help="16 new tokens, 1 timed run, a few held-out windows")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for PyTorch and ONNX Runtime")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (after a warm-up); the median counts")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens")
    parser.add_argument("--attn", default="sdpa", help="PyTorch attention backend")
    parser.add_argument("--optimize", action="store_true", help="also time an export with ORT's offline fusions")
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/onnx-benchmark"), help="exports live here")
    parser.add_argument("--fresh", action="store_true", help="export again even if --work-dir has the exports")
    parser.add_argument("--demo-model", type=Path, default=Path("outputs/demo-model"), help="examples/demo.py output")
    parser.add_argument("--train-demo", action="store_true", help="train the demo model if --demo-model is empty")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--json", type=Path, help="raw results and tables as JSON; the page is rendered from it")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.quick:
        args.new_tokens, args.repeats = 16, 1
    args.batch, args.extra = 1, {}

    torch.set_num_threads(args.threads)
    models = reference_models()
    for model in models.values():
        model.set_attn_implementation(args.attn)
    header = (
        f"CPU: {args.threads} threads for both; batch 1, {args.prompt}-token random prompt, {args.new_tokens} new "
        f"tokens greedy; median of {args.repeats} after a warm-up; torch {torch.__version__}, onnxruntime "
        f"{__import__('onnxruntime').__version__}{' (--quick: not the reference workload)' if args.quick else ''}"
    )
    print(header, flush=True)
    tables = [header]
    for name in sections:
        print(f"{name}:", flush=True)
        tables.append(BENCHES[name](models, args))
    report = "\n\n".join(tables)
    print("\n" + report)
    if args.json:  # the page: rendered from the JSON (benchmarks/results/)
        from benchmarks.results.pages import publish_report

        publish_report(report, args.json, args.markdown, {"sections": sections, "tables": tables[1:]}, args.threads)
    elif args.markdown:
        Path(args.markdown).write_text(report + "\n")


if __name__ == "__main__":
    main()
