"""Shared helpers for the test suite: tiny configs and models that run in milliseconds on a CPU.

Import them in a test module with `from conftest import tiny_decoder_config, build_causal_lm`.

Every model is built from a deep copy of its config: `Model._from_config(config, attn_implementation=...)` writes
the backend into the config object it is given, so two models built from one shared config object would silently
share (and overwrite) each other's attention backend.
"""

import copy
import gc
import importlib
import os
import re
from pathlib import Path
from typing import TypeVar

import pytest
import tomllib
import torch
from transformers import PreTrainedConfig, PreTrainedModel

from vaswani import VaswaniDecoderConfig, VaswaniEncoderConfig, VaswaniForCausalLM, VaswaniSeq2SeqConfig
from vaswani.modeling.configuration import POSITION_EMBEDDING_TYPES

# Tiny tensors gain nothing from intra-op threads, and on a shared machine the threads' spin-waiting makes every op
# 10-50x slower. One thread keeps the suite fast and its timings steady.
torch.set_num_threads(1)

# Large enough to exercise every code path, small enough for a shared 2-core machine.
TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    # A wide init keeps logits far from uniform, so greedy decoding has no near-ties between tokens and token-for-
    # token comparisons test something (at the default 0.02 every next token is a coin flip decided by rounding).
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# The same shape for the bidirectional encoder family (no bos/eos: encoders do not generate).
TINY_ENCODER = {key: value for key, value in TINY_DECODER.items() if key not in ("bos_token_id", "eos_token_id")}

# And for the encoder-decoder family; the decoder starts from the end-of-sequence id, as in the paper's (fairseq)
# and BART's models.
TINY_SEQ2SEQ = dict(TINY_DECODER, decoder_start_token_id=2)

# fp32 outputs of the tiny models that must agree (two backends, cached and uncached steps, converted checkpoints):
# they differ only by summation order, a few float32 ulps.
TOLERANCE = 1e-5

# num_key_value_heads for the 4 query heads of TINY_DECODER.
ATTENTION_SHAPES = {"mha": 4, "gqa": 2, "mqa": 1}

POSITION_TYPES = POSITION_EMBEDDING_TYPES

Model = TypeVar("Model", bound=PreTrainedModel)


def tiny_decoder_config(**overrides) -> VaswaniDecoderConfig:
    """A tiny `VaswaniDecoderConfig`; `overrides` change any field."""
    return VaswaniDecoderConfig(**{**TINY_DECODER, **overrides})


def tiny_encoder_config(**overrides) -> VaswaniEncoderConfig:
    """A tiny `VaswaniEncoderConfig`; `overrides` change any field."""
    return VaswaniEncoderConfig(**{**TINY_ENCODER, **overrides})


def tiny_seq2seq_config(**overrides) -> VaswaniSeq2SeqConfig:
    """A tiny `VaswaniSeq2SeqConfig`; `overrides` change any field."""
    return VaswaniSeq2SeqConfig(**{**TINY_SEQ2SEQ, **overrides})


def build_model(
    model_class: type[Model], config: PreTrainedConfig, attn_implementation: str = "eager", seed: int = 0
) -> Model:
    """A `model_class` in eval mode with seeded random weights, built from a deep copy of `config`."""
    torch.manual_seed(seed)
    return model_class._from_config(copy.deepcopy(config), attn_implementation=attn_implementation).eval()


def build_causal_lm(
    config: VaswaniDecoderConfig, attn_implementation: str = "eager", seed: int = 0
) -> VaswaniForCausalLM:
    """A `VaswaniForCausalLM` in eval mode with seeded random weights, built from a deep copy of `config`."""
    torch.manual_seed(seed)
    return VaswaniForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn_implementation).eval()


# torch's CPU flex_attention kernel is compiled per CPU, and its numerics differ between instruction sets: on AVX2-only
# CPUs (no AVX-512) torch 2.13 returns wrong values, even NaN, for heads 16 wide or narrower at some lengths (8 and 24
# went wrong, 10 did not), in transformers' own models exactly as in ours. Flex cases therefore use 32-wide heads.
FLEX_SHAPE = dict(hidden_size=64, num_attention_heads=2, intermediate_size=128)


def with_attention_backend(model: Model, attn_implementation: str) -> Model:
    """A twin of `model` (same config and weights) that runs `attn_implementation`."""
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation=attn_implementation)
    twin.load_state_dict(model.state_dict())
    assert twin.config._attn_implementation == attn_implementation
    return twin.eval()


def random_ids(batch: int, length: int, vocab_size: int = TINY_DECODER["vocab_size"], seed: int = 0) -> torch.Tensor:
    """Token ids that avoid the special ids 0-2, so no prompt contains padding or end-of-sequence by accident."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def padding_mask(lengths: list[int], total: int, side: str) -> torch.Tensor:
    """A (batch, total) attention mask with `lengths[i]` ones per row, padded on the `left` or `right`."""
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, length in enumerate(lengths):
        if side == "left":
            mask[row, total - length :] = 1
        else:
            mask[row, :length] = 1
    return mask


def max_diff_where(mask: torch.Tensor, actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the (batch, positions) where `mask` is 1, i.e. the real tokens."""
    keep = mask.bool()
    return (actual[keep] - expected[keep]).abs().max().item()


# The growth of the heap (garbage included) since the last full collection at which a test starts with one, as
# Python's own rule for full collections; checked every HEAP_CHECK_EVERY tests (counting the frozen heap takes ~8 ms).
GARBAGE_GROWTH, HEAP_CHECK_EVERY = 0.25, 10
_heap = {"tests": 0, "after_full_collection": 0}


@pytest.fixture(autouse=True)
def collect_the_tests_own_objects():
    """Collections during a test walk only what the test made: what was alive before it is frozen (`gc.freeze`).

    Session fixtures (exported graphs, traced programs, trained models) keep ~10^6 objects alive, and every full
    collection Python starts by itself walked them all (0.5-2 s each, ~15% of the default run); continuous batching's
    own `gc.collect()` did too. Frozen objects go back to the collector after the test, and the garbage that earlier
    tests left is collected before a test once the heap has grown by GARBAGE_GROWTH."""
    gc.freeze()
    _heap["tests"] += 1
    if (
        _heap["tests"] % HEAP_CHECK_EVERY == 0
        and gc.get_freeze_count() > (1 + GARBAGE_GROWTH) * _heap["after_full_collection"]
    ):
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        _heap["after_full_collection"] = gc.get_freeze_count()
    yield
    gc.unfreeze()


@pytest.fixture
def fresh_dynamo():
    """A clean compiler state around a flex_attention case: torch 2.13's CPU inductor can generate broken code when
    flex_attention recompiles for a new score_mod or shape in a process that already compiled it."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------- installed extras under CI

# The extras `make setup` installs (the Makefile's EXTRAS), and the modules by which the tests import them.
INSTALLED_EXTRAS = ("onnx", "openvino", "train", "serve", "ray", "dev")
IMPORT_NAMES = {"onnx-ir": "onnx_ir", "ray": "ray.serve", "uvicorn": "uvicorn", "ruff": None, "pytest-xdist": "xdist"}


def declared_extra_modules() -> dict[str, str]:
    """{distribution: module} for every requirement of INSTALLED_EXTRAS in pyproject.toml."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    modules = {}
    for extra in INSTALLED_EXTRAS:
        for requirement in project["optional-dependencies"][extra]:
            name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]
            module = IMPORT_NAMES.get(name, name.replace("-", "_"))
            if module is not None:
                modules[name] = module
    return modules


@pytest.fixture(scope="session")
def tiny_chat_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"pytorch": folder, "onnx": its fp32 export} of a tiny chat model (serving_cases.tiny_chat_folders), made once
    per session for the tests of the commands that take a FOLDER; tests read these folders and never write them."""
    from serving_cases import tiny_chat_folders, tiny_chat_tokenizer

    torch_folder, onnx_folder = tiny_chat_folders(tmp_path_factory.mktemp("tiny_chat_pair"), tiny_chat_tokenizer())
    return {"pytorch": torch_folder, "onnx": onnx_folder}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under CI (`CI=true`), every declared extra must import: the ONNX, serving and training tests skip where theirs
    is missing, so a broken extra would otherwise turn hundreds of tests into skips and leave the run green."""
    if os.environ.get("CI", "").lower() != "true":
        return
    broken = []
    for name, module in declared_extra_modules().items():
        try:
            importlib.import_module(module)
        except Exception as error:  # an extra that is installed but broken counts as missing
            broken.append(f"{name} ({module}): {type(error).__name__}: {error}")
    if broken:
        pytest.exit("CI=true, but declared extras do not import:\n  " + "\n  ".join(broken), returncode=3)
