"""Reference models for benchmarks: transformers `LlamaForCausalLM` folders in the shapes of published checkpoints,
with seeded random weights at a trained model's scales.

    python -m benchmarks.reference_shapes --shape llama-3.2-1b --output /tmp/big/llama-1b
    python -m benchmarks.reference_shapes --shape smollm2-360m --output /tmp/big/smol-360m --dtype float16

Shapes (`shapes/NAME.json`: the published config.json, nothing else of the checkpoint):
- `smollm2-135m`: hidden 576, 30 layers, 9 heads / 3 KV heads, FFN 1536, vocabulary 49,152, tied embeddings;
- `smollm2-360m`: hidden 960, 32 layers, 15 heads / 5 KV heads, FFN 2560, vocabulary 49,152, tied, rope theta 1e5;
- `llama-3.2-1b`: hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192, vocabulary 128,256, tied, llama3 rope
  (theta 5e5): 1.24B parameters, 4.9 GB in float32.

Speed does not depend on the values, so these folders measure speed and memory, never quality. The values are still
drawn at a trained model's scales, so that activations (and what validation and quantization see) sit where a trained
model puts them: each tensor is drawn from a normal distribution at the mean and standard deviation of its
counterpart in the trained SmolLM2-135M-Instruct (`shapes/smollm2-135m.json`, the only trained statistics we have).
Other shapes map onto it by role and relative depth: layer i of L takes the statistics of SmolLM2-135M's layer
round(i * 29 / (L - 1)), same projection (q/k/v/o, gate/up/down) or norm; a projection's statistics are scaled by
sqrt(135M's fan-in / this fan-in), which keeps its outputs at the trained model's scale when the hidden or FFN width
differs; norms and the embedding keep theirs.

The tokenizer is the repository's own (a ChatML byte-level BPE of 1,002 tokens trained on the bundled stories, as the
other benchmarks use), or with `--tokenizer DIR` the tokenizer files of another folder (e.g. SmolLM2's of
/tmp/smol/hf: its 49,152 ids fit every vocabulary here). Either way prompts use only the first ids of the
vocabulary, which changes nothing in a decode step's cost. The generation config has no end-of-sequence token: every
benchmark row decodes its full count.

The seq2seq benchmarks' reference model is BART-shaped (`build_reference_bart`, benchmarks/benchmark.py's
`BART_SHAPE`): `python -m benchmarks.benchmark_engines --seq2seq --make-reference-bart` writes it.

Writing the weights holds one tensor at a time (each drawn from its own seeded generator and streamed into a single
`model.safetensors`, as transformers writes a model under its 50 GB shard size), so a 1B folder needs about one
embedding's worth of memory (0.5-1 GB), not the model's.
"""

import argparse
import json
import math
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

SHAPES_FOLDER = Path(__file__).resolve().parent / "shapes"
SHAPES = ("llama-3.2-1b", "smollm2-135m", "smollm2-360m")
SCALES_SOURCE = "smollm2-135m"  # the shape whose trained tensors' statistics the others borrow
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def shape_recipe(shape: str) -> dict:
    """`shapes/SHAPE.json`: its `config` (transformers LlamaConfig keys) and `source`; the scales source has `scales`."""
    if shape not in SHAPES:
        raise ValueError(f"Unknown shape {shape!r}; use one of {list(SHAPES)}.")
    return json.loads((SHAPES_FOLDER / f"{shape}.json").read_text())


def parameter_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a `save_pretrained` folder of `config` holds, in the model's order (a tied LM head is the
    embedding, saved once); from a model on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}


def scale_of(name: str, shape: tuple[int, ...], config: LlamaConfig, source: dict) -> tuple[float, float]:
    """(mean, std) to draw parameter `name` of `config` at: its counterpart's in the source's trained statistics,
    by role and relative depth, a projection's rescaled by sqrt(source fan-in / fan-in) (see the module's docstring)."""
    scales, layers = source["scales"], source["config"]["num_hidden_layers"]
    counterpart = name
    if name.startswith("model.layers."):
        index, role = name.removeprefix("model.layers.").split(".", 1)
        depth = config.num_hidden_layers
        counterpart = f"model.layers.{round(int(index) * (layers - 1) / max(depth - 1, 1))}.{role}"
    if counterpart not in scales:
        raise KeyError(f"No trained statistics for {name} (looked for {counterpart} in {SCALES_SOURCE}).")
    mean, std = scales[counterpart]
    if len(shape) == 2 and counterpart != "model.embed_tokens.weight":
        source_fan_in = _source_fan_in(counterpart, source["config"])
        factor = math.sqrt(source_fan_in / shape[1])
        mean, std = mean * factor, std * factor
    return mean, std


def _source_fan_in(name: str, config: dict) -> int:
    """The input width of a projection of the source shape (o_proj reads the heads, down_proj the FFN)."""
    if name.endswith("o_proj.weight"):
        return config["num_attention_heads"] * config["head_dim"]
    if name.endswith("down_proj.weight"):
        return config["intermediate_size"]
    return config["hidden_size"]


def drawn_tensors(config: LlamaConfig, dtype: torch.dtype, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter of `config`, drawn one at a time: parameter k from a generator seeded with seed * 100003 + k,
    so a folder is the same whatever draws before it."""
    source = shape_recipe(SCALES_SOURCE)
    for index, (name, shape) in enumerate(parameter_shapes(config).items()):
        mean, std = scale_of(name, shape, config, source)
        generator = torch.Generator().manual_seed(seed * 100003 + index)
        tensor = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator)
        yield name, tensor.to(dtype)


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, tensors: Iterator) -> None:
    """A safetensors file of `shapes` (all of `dtype`), its tensors taken from `tensors` in the same order and written
    as they come: the header (names, dtypes, shapes, byte offsets) is known from the shapes before any is drawn."""
    item = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * item
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for (name, shape), (drawn_name, tensor) in zip(shapes.items(), tensors, strict=True):
            if drawn_name != name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(f"Drew {drawn_name} {tuple(tensor.shape)} where {name} {shape} was announced.")
            handle.write(tensor.contiguous().view(torch.uint8).numpy().data)


def write_reference_folder(
    shape: str,
    output: str | Path,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer: str | Path | None = None,
    progress: Callable[[str], None] = print,
) -> Path:
    """Write a `LlamaForCausalLM` folder of `shape` (`SHAPES`) with seeded random weights at trained scales to
    `output`: config.json, generation_config.json, model.safetensors and tokenizer files. Returns the folder.

    Example:
        >>> folder = write_reference_folder("smollm2-360m", "/tmp/smol-360m")
        >>> LlamaForCausalLM.from_pretrained(folder).num_parameters()
        361821120
    """
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {list(SAFETENSORS_DTYPES)}.")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**shape_recipe(shape)["config"])
    config.dtype = dtype
    shapes = parameter_shapes(config)
    count = sum(math.prod(size) for size in shapes.values())
    progress(f"Writing {shape}: {count / 1e9:.3f}B parameters, {str(dtype).removeprefix('torch.')}, to {output}")
    write_safetensors(output / "model.safetensors", shapes, dtype, drawn_tensors(config, dtype, seed))
    config.save_pretrained(output)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = None  # random weights: every benchmark row decodes its full count
    generation.save_pretrained(output)
    _write_tokenizer(output, tokenizer, config.vocab_size)
    return output


def _write_tokenizer(output: Path, source: str | Path | None, vocab_size: int) -> None:
    if source is None:
        from vaswani.data import corpus_stories
        from vaswani.data.chat import chat_tokenizer

        chat_tokenizer(corpus_stories()[:300], vocab_size=1000).save_pretrained(output)
        return
    source = Path(source)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(
            f"{source} has no tokenizer.json; pass a folder with a fast tokenizer, or no --tokenizer."
        )
    ids = len(json.loads((source / "tokenizer.json").read_text())["model"]["vocab"])
    if ids > vocab_size:
        raise ValueError(f"{source}'s tokenizer has {ids} ids; this shape's vocabulary has only {vocab_size}.")
    for name in copied:
        shutil.copy2(source / name, output / name)


# ------------------------------------------------------------------ the BART-shaped reference model (seq2seq)


def build_reference_bart(folder: Path, seed: int = 0) -> None:
    """The BART-shaped reference model (vocab 8000, d_model 512, 6+6 layers, 8 heads, FFN 2048, learned positions,
    post-LN, GELU: benchmarks/benchmark.py's BART_SHAPE) as a transformers folder that CTranslate2's converter accepts:
    BartForConditionalGeneration with seeded random weights and a byte-level BPE tokenizer trained on the
    package's story corpus. Nothing is downloaded.

    The corpus has too few frequent pairs for 8000 merges, so the vocabulary is filled up to the model's 8000 rows
    with placeholder tokens: every id the model can emit then has a token string, which CTranslate2 needs (it takes
    and returns tokens, not ids). CTranslate2's converter also needs an unknown token and reads
    `config.normalize_before`, a field transformers 5 dropped from BartConfig (False: BART is post-LN)."""
    from transformers import BartConfig, BartForConditionalGeneration

    from benchmarks.benchmark import BART_SHAPE
    from vaswani.data import corpus_stories
    from vaswani.data.tokenization import train_tokenizer

    vocab_size = BART_SHAPE["vocab_size"]
    tokenizer = train_tokenizer(corpus_stories(), vocab_size=vocab_size, model_max_length=1024)
    tokenizer.add_special_tokens({"unk_token": "<|unk|>"})
    tokenizer.add_tokens([f"<|unused_{index}|>" for index in range(vocab_size - len(tokenizer))])
    config = BartConfig(
        **BART_SHAPE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=tokenizer.eos_token_id,
        forced_eos_token_id=None,  # BartConfig's default forces end-of-sequence as the last token; CTranslate2 does not
        normalize_before=False,
    )
    torch.manual_seed(seed)
    BartForConditionalGeneration(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def seq2seq_step_parameters(folder: Path) -> int:
    """Parameters one decoder step of a BART folder reads: the decoder's layers (less the cross-attention key and
    value projections, applied to the encoder's output once per sequence), its layer norms and the LM head (the
    shared embedding, read once); the learned position table is only gathered from (one row per token)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
        for name in weights.keys():
            shape = weights.get_slice(name).get_shape()
            size = 1
            for dimension in shape:
                size *= dimension
            cross_key_value = "encoder_attn.k_proj" in name or "encoder_attn.v_proj" in name
            in_step = name.startswith("model.decoder.") and "embed_positions" not in name and not cross_key_value
            total += size if in_step or name in ("model.shared.weight", "final_logits_bias") else 0
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, required=True)
    parser.add_argument("--output", type=Path, required=True, help="the folder to write")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, help="copy this folder's tokenizer files (default: the repo's own)")
    args = parser.parse_args()
    write_reference_folder(args.shape, args.output, getattr(torch, args.dtype), args.seed, args.tokenizer)


if __name__ == "__main__":
    main()
