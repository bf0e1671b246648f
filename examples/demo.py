"""Train a small LLaMA-shaped vaswani decoder on the shipped corpus in about a minute, on a CPU.

The whole life of a model in one file: train a tokenizer, build a model from a preset, train it on a clock
budget, measure held-out perplexity before and after, `save_pretrained` it, load it back through
transformers' Auto classes, and generate text from it; then export it to ONNX and generate with ONNX Runtime.

    python examples/demo.py                   # one minute of training (the default)
    python examples/demo.py --seconds 20      # shorter
    python examples/demo.py --steps 200       # a fixed number of steps instead of a clock budget: reproducible
    python examples/demo.py --no-onnx         # skip the ONNX export and ONNX Runtime generation

Everything is seeded, so two runs with `--steps` give the same model; with a clock budget the step count (and
so the result) depends on how fast the machine is.
"""

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Threads that wait for work sleep instead of spinning: on a CPU shared with other programs, spinning OpenMP
# threads can make training many times slower. Read when torch loads, so it must be set before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import vaswani  # noqa: F401  (registers the vaswani models with transformers' Auto classes)
from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
from vaswani.data import corpus_stories
from vaswani.data.tokenization import train_tokenizer
from vaswani.evaluation.perplexity import summed_nll
from vaswani.training import save_loss_curve

PROMPTS = ("Once upon a time, there was", "There once was a clever fox. Her name was")


@dataclass
class Args:
    seconds: float
    steps: int | None
    output: Path
    seed: int
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    block_size: int
    batch_size: int
    learning_rate: float
    max_new_tokens: int
    onnx: bool


def parse_args() -> Args:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="training time budget in seconds")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead of --seconds")
    parser.add_argument("--output", type=Path, default=Path("outputs/demo-model"), help="where to save the model")
    parser.add_argument("--seed", type=int, default=0, help="seeds weights, batches and sampling")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    parser.add_argument("--hidden-size", type=int, default=128, help="model width, a multiple of 32 (32-wide heads)")
    parser.add_argument("--num-hidden-layers", type=int, default=4, help="Transformer blocks")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="small batches: more updates per second")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--max-new-tokens", type=int, default=60, help="tokens generated per prompt")
    parser.add_argument(
        "--no-onnx", dest="onnx", action="store_false", help="skip exporting to ONNX and generating with ONNX Runtime"
    )
    args = Args(**vars(parser.parse_args()))
    if args.seconds <= 0 or (args.steps is not None and args.steps < 1):
        parser.error("--seconds must be positive and --steps at least 1")
    if args.hidden_size % 32:
        parser.error(f"--hidden-size must be a multiple of 32 (the heads are 32 wide), got {args.hidden_size}")
    return args


# ------------------------------------------------------------------------------------------------------ data


def load_data(vocab_size: int) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor]:
    """Train a tokenizer on 90% of the stories; return it and the train/held-out token streams.

    The held-out stories are never seen by the tokenizer or the model, so their loss measures generalization.
    Stories are joined with `<|endoftext|>`, which also serves as the prompt's start-of-story token.
    """
    stories = corpus_stories()
    n_train = int(0.9 * len(stories))
    tokenizer = train_tokenizer(stories[:n_train], vocab_size=vocab_size)

    def encode(texts: list[str]) -> torch.Tensor:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return torch.tensor([token for story in ids for token in [tokenizer.eos_token_id, *story]])

    return tokenizer, encode(stories[:n_train]), encode(stories[n_train:])


def random_batch(data: torch.Tensor, block_size: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` windows of `block_size` tokens at random offsets (nanoGPT's sampler)."""
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    return torch.stack([data[start : start + block_size] for start in starts.tolist()])


@torch.no_grad()
def evaluate(model: VaswaniForCausalLM, data: torch.Tensor, block_size: int, batch_size: int) -> float:
    """Mean next-token loss over consecutive, non-overlapping windows of `data` (the same ones every call):
    `vaswani perplexity`'s definition with context = stride = `block_size`, `batch_size` windows per forward."""
    model.eval()
    data = data[: len(data) // block_size * block_size]
    total, count = summed_nll(model, data, "text-generation", block_size, batch_tokens=batch_size * block_size)
    model.train()
    return total / count


# -------------------------------------------------------------------------------------------------- training


def learning_rate(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to `floor * peak`, as a function of the budget used (0..1).

    Driving the schedule by the fraction of the budget rather than by a step count lets a clock-budgeted run
    finish its decay however fast the machine is.
    """
    if progress < warmup:
        return peak * progress / warmup
    decay = (progress - warmup) / (1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(decay, 1.0))))


def train(model: VaswaniForCausalLM, data: torch.Tensor, args: Args) -> list[float]:
    """Train until the clock (or step) budget runs out; return the loss of every step."""
    generator = torch.Generator().manual_seed(args.seed)
    # No weight decay on norms (1-D weights): decaying their gains toward zero only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.learning_rate,
        betas=(0.9, 0.95),
    )
    total = args.steps if args.steps is not None else args.seconds
    unit = "step" if args.steps is not None else "s"
    bar = tqdm(total=total, desc="training", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} " + unit + "{postfix}")
    losses: list[float] = []
    start = time.perf_counter()
    progress = 0.0
    model.train()
    while progress < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(progress, args.learning_rate)
        batch = random_batch(data, args.block_size, args.batch_size, generator)
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())

        elapsed = time.perf_counter() - start
        done = len(losses) if args.steps is not None else min(elapsed, args.seconds)
        lr = optimizer.param_groups[0]["lr"]
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.1e}", step=len(losses), refresh=False)
        bar.update(done - bar.n)
        progress = done / total
    bar.close()
    seconds = time.perf_counter() - start
    tokens = len(losses) * args.batch_size * args.block_size
    print(f"trained {len(losses)} steps ({tokens:,} tokens) in {seconds:.1f} s: {tokens / seconds:,.0f} tokens/s")
    return losses


# ------------------------------------------------------------------------------------------------ generation


def show_generations(model_dir: Path, max_new_tokens: int, seed: int) -> None:
    """Load the saved model with the Auto classes, as any transformers user would, and continue the prompts."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    print(f"\nreloaded {type(model).__name__} and {type(tokenizer).__name__} from {model_dir}")
    torch.manual_seed(seed)  # sampling draws from the global generator
    for prompt in PROMPTS:
        # Training stories start right after <|endoftext|>, so a prompt does too.
        inputs = tokenizer(tokenizer.bos_token + prompt, return_tensors="pt", add_special_tokens=False)
        for name, sampling in (
            ("greedy", dict(do_sample=False)),
            ("sampled", dict(do_sample=True, temperature=0.8, top_k=50)),
        ):
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **sampling
            )
            text = tokenizer.decode(output[0], skip_special_tokens=True)
            print(f"\n[{name}] {text}")


def deploy_with_onnx(model_dir: Path, onnx_dir: Path, max_new_tokens: int) -> None:
    """Export the saved model to ONNX (validated against PyTorch), then generate with ONNX Runtime and compare."""
    from vaswani.export import export_onnx
    from vaswani.runtime import OrtModelForCausalLM

    print(f"\nexporting {model_dir} to ONNX ...")
    result = export_onnx(model_dir, onnx_dir, task="text-generation", overwrite=True)
    print(f"wrote {result.folder}; ONNX Runtime vs PyTorch on fresh inputs:\n{result.validation}")

    ort_model = OrtModelForCausalLM.from_pretrained(onnx_dir)
    torch_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(onnx_dir)  # the export carries the tokenizer
    inputs = tokenizer(tokenizer.bos_token + PROMPTS[0], return_tensors="pt", add_special_tokens=False)
    settings = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
    outputs = {}
    for name, model in (("PyTorch", torch_model), ("ONNX Runtime", ort_model)):
        model.generate(**inputs, **settings)  # warm-up
        start = time.perf_counter()
        outputs[name] = model.generate(**inputs, **settings)
        seconds = time.perf_counter() - start
        print(f"[{name}] {max_new_tokens / seconds:,.0f} tokens/s greedy")
    print(f"\n[ONNX Runtime, greedy] {tokenizer.decode(outputs['ONNX Runtime'][0], skip_special_tokens=True)}")
    same = torch.equal(outputs["PyTorch"], outputs["ONNX Runtime"])
    print(f"ONNX Runtime's greedy tokens are {'identical to' if same else 'DIFFERENT from'} PyTorch's")


# ------------------------------------------------------------------------------------------------------ main


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)

    tokenizer, train_data, val_data = load_data(args.vocab_size)
    print(f"corpus: {len(train_data):,} training and {len(val_data):,} held-out tokens, vocabulary {len(tokenizer)}")

    config = VaswaniDecoderConfig.from_preset(
        "llama",  # RoPE, RMSNorm, SwiGLU, grouped-query attention
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.hidden_size // 32,  # 32-wide heads
        num_key_value_heads=math.gcd(args.hidden_size // 32, 2),  # grouped-query: (up to) 2 key/value heads
        intermediate_size=round(8 / 3 * args.hidden_size / 16) * 16,  # LLaMA's 8/3 ratio keeps SwiGLU's size
        max_position_embeddings=args.block_size,
        tie_word_embeddings=True,  # with a small vocabulary, a separate output matrix would double the embeddings
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = VaswaniForCausalLM(config)
    print(
        f"model: {model.num_parameters():,} parameters, {config.num_hidden_layers} layers, hidden {config.hidden_size}"
    )

    eval_before = evaluate(model, val_data, args.block_size, args.batch_size)
    print(f"held-out loss before training: {eval_before:.3f} (perplexity {math.exp(eval_before):,.1f})")
    losses = train(model, train_data, args)
    eval_after = evaluate(model, val_data, args.block_size, args.batch_size)
    print(f"held-out loss after training:  {eval_after:.3f} (perplexity {math.exp(eval_after):,.1f})")

    model.save_pretrained(args.output)  # config.json + model.safetensors (+ the model code, for trust_remote_code)
    tokenizer.save_pretrained(args.output)
    print(f"saved model and tokenizer to {args.output}")
    # The held-out loss before step 1 and after the last, beside every step's batch loss.
    history = [
        {"step": 0, "eval_loss": eval_before},
        *({"step": step, "loss": loss} for step, loss in enumerate(losses, 1)),
    ]
    history.append({"step": len(losses), "eval_loss": eval_after})
    title = "vaswani demo: LLaMA-shaped decoder on the shipped corpus"
    if save_loss_curve(history, args.output / "loss_curve.png", title) is None:
        print("matplotlib is not installed (pip install -e '.[train]'): skipping the loss curve")
    else:
        print(f"loss curve: {args.output / 'loss_curve.png'}")

    show_generations(args.output, args.max_new_tokens, args.seed)
    if args.onnx:
        deploy_with_onnx(args.output, args.output.with_name(args.output.name + "-onnx"), args.max_new_tokens)


if __name__ == "__main__":
    main()
