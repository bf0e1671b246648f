"""A folder saved under one supported transformers loads and generates under another, without vaswani installed.

`.ci/run` saves folders with the newest releases and checks them in the floor environment, then the other way round:

    .venv/bin/python tests/cross_version.py save build/cross-version/newest
    .venv-floor/bin/python tests/cross_version.py check build/cross-version/newest

`save` writes a causal LM and an encoder-decoder (`save_pretrained`, which copies the modeling code into the folder),
a prompt, and the greedy tokens and logits vaswani's own classes give under the saving release. `check` hides the
vaswani package, loads each folder with `trust_remote_code=True` (the folder's own code), and requires the same
tokens, logits within float tolerance, and cached generation equal to uncached.
"""

import argparse
import importlib.abc
import json
import sys
from pathlib import Path

import torch

NEW_TOKENS = 8
TOLERANCE = 1e-4  # the same fp32 weights and code; only the transformers around them differ
MODELS = {"causal_lm": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM"}


def save(directory: Path) -> None:
    import transformers

    from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniSeq2SeqConfig

    shape = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, intermediate_size=64, initializer_range=0.2)
    specials = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    models = {
        # GQA with RoPE (the common decoder) and the paper's encoder-decoder with a relative bias, both cached.
        "causal_lm": VaswaniForCausalLM(
            VaswaniDecoderConfig.from_preset("llama", num_hidden_layers=2, num_key_value_heads=2, **shape, **specials)
        ),
        "seq2seq": VaswaniForConditionalGeneration(
            VaswaniSeq2SeqConfig.from_preset(
                "t5", encoder_layers=2, decoder_layers=2, decoder_start_token_id=0, **shape, **specials
            )
        ),
    }
    prompt = torch.randint(3, shape["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    record = {"transformers": transformers.__version__, "prompt": prompt.tolist(), "models": {}}
    for name, model in models.items():
        torch.manual_seed(0)
        model.eval().save_pretrained(directory / name)
        tokens, logits = greedy(model, prompt)
        record["models"][name] = {"tokens": tokens.tolist(), "logits": logits.tolist()}
    (directory / "expected.json").write_text(json.dumps(record))
    print(f"saved {', '.join(models)} under transformers {transformers.__version__} in {directory}")


def greedy(model, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens (cached and uncached must agree) and the logits of every generated step."""
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(prompt, return_dict_in_generate=True, output_logits=True, **settings)
        uncached = model.generate(prompt, use_cache=False, **settings)
    if not torch.equal(cached.sequences, uncached):
        raise AssertionError(f"cached and uncached generation differ:\n{cached.sequences}\n{uncached}")
    return cached.sequences, torch.stack(cached.logits, dim=1)


class NoVaswani(importlib.abc.MetaPathFinder):
    """First on the meta path: the vaswani package cannot be imported, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vaswani":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the cross-version check)", name=name)


def check(directory: Path) -> None:
    sys.meta_path.insert(0, NoVaswani())
    import transformers

    record = json.loads((directory / "expected.json").read_text())
    prompt = torch.tensor(record["prompt"])
    for name, auto_class in MODELS.items():
        model = getattr(transformers, auto_class).from_pretrained(directory / name, trust_remote_code=True).eval()
        if not type(model).__module__.startswith("transformers_modules."):
            raise AssertionError(f"{name} was not loaded from the folder's own code: {type(model).__module__}")
        tokens, logits = greedy(model, prompt)
        expected = record["models"][name]
        if tokens.tolist() != expected["tokens"]:
            raise AssertionError(
                f"{name}: tokens {tokens.tolist()} != {expected['tokens']} saved under "
                f"transformers {record['transformers']}"
            )
        difference = (logits - torch.tensor(expected["logits"])).abs().max().item()
        if difference > TOLERANCE:
            raise AssertionError(f"{name}: logits differ by {difference} from those saved")
    if any(module.split(".")[0] == "vaswani" for module in sys.modules):
        raise AssertionError("vaswani was imported: the check would prove nothing")
    print(
        f"folders saved under transformers {record['transformers']} load and generate the same tokens under "
        f"{transformers.__version__} without vaswani installed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "check"))
    parser.add_argument("directory", type=Path)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    (save if arguments.action == "save" else check)(arguments.directory)


if __name__ == "__main__":
    main()
