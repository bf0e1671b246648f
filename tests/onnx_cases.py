"""The exports and ONNX Runtime models that the ONNX test modules share, each made once per test session (exporting
is the slow part). Test modules load it with `pytest_plugins = ["onnx_cases"]` after skipping when onnx or
onnxruntime is missing.

- `exported`, for test_onnx_export.py, test_onnx_contract.py and test_onnx_validation.py: one export per case (model,
  position type, attention shape, task, opset or dtype), validated as part of the export.
- `exports`, `load` and `tokenizer`, for test_onnx_runtime.py and test_onnx_generation.py: tiny models exported
  without validation (those tests compare with PyTorch themselves; the encoder heads of TASK_EXPORTS are `exported`'s
  validated ones), their ONNX Runtime models, and padded inputs. Tests read the folders and never write them.

PYTEST_DONT_REWRITE: this module holds no asserts, and the test modules import it before pytest loads it as a
plugin, which would otherwise warn that it cannot be rewritten.
"""

import onnxruntime as ort
import pytest
import torch
from conftest import (
    build_model,
    padding_mask,
    random_ids,
    tiny_decoder_config,
    tiny_encoder_config,
    tiny_seq2seq_config,
)

from vaswani import (
    VaswaniDecoderForSequenceClassification,
    VaswaniEncoderForSequenceClassification,
    VaswaniEncoderModel,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
    VaswaniForTokenClassification,
)
from vaswani.data.tokenization import corpus_tokenizer
from vaswani.export import export_onnx
from vaswani.runtime import default_session_options

# ------------------------------------------------------------------------- the export, contract and validation tests

KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}

# position type -> (attention shape, layers, export options): each position type once, each attention shape twice;
# one export is optimized (it must validate at the fp32 tolerance too). Rope is LLaMA-style (RMSNorm, SwiGLU).
GENERATION_CASES = {
    "rope": ("gqa", 2, {}),
    "sinusoidal": ("mha", 1, {}),
    "learned": ("mqa", 1, {}),
    "alibi": ("gqa", 1, {"optimize": True}),
    "relative_bias": ("mha", 1, {}),
    "none": ("mqa", 1, {}),
}
LLAMA_STYLE = {"norm_type": "rmsnorm", "gated_ffn": True, "hidden_act": "silu"}
# A decoder the GroupQueryAttention form takes: head_dim 16, since ONNX Runtime's kernel needs a multiple of 16 (the
# shared tiny decoder has 8, which is the fallback case).
GQA_DECODER = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, position_embedding_type="rope", **LLAMA_STYLE
)
SEQ2SEQ_CASES = {"relative_bias": ("gqa", 1), "learned": ("mha", 1)}

# (family, task) -> (model class, config, expected outputs): one position type each, spread over the six.
TASK_CASES = {
    ("encoder", "feature-extraction"): (
        VaswaniEncoderModel,
        lambda: tiny_encoder_config(
            num_hidden_layers=1, position_embedding_type="sinusoidal", add_pooler=True, type_vocab_size=2
        ),
        ["last_hidden_state", "pooler_output"],
    ),
    ("encoder", "fill-mask"): (
        VaswaniForMaskedLM,
        lambda: tiny_encoder_config(num_hidden_layers=1, position_embedding_type="learned"),
        ["logits"],
    ),
    ("encoder", "text-classification"): (
        VaswaniEncoderForSequenceClassification,
        lambda: tiny_encoder_config(
            num_hidden_layers=1, position_embedding_type="rope", num_labels=3, classifier_pooling="mean"
        ),
        ["logits"],
    ),
    ("encoder", "token-classification"): (
        VaswaniForTokenClassification,
        lambda: tiny_encoder_config(num_hidden_layers=1, position_embedding_type="alibi", num_labels=5),
        ["logits"],
    ),
    ("decoder", "feature-extraction"): (
        VaswaniForCausalLM,  # a causal LM's bare stack
        lambda: tiny_decoder_config(num_hidden_layers=1, position_embedding_type="none"),
        ["last_hidden_state"],
    ),
    ("decoder", "text-classification"): (
        VaswaniDecoderForSequenceClassification,
        lambda: tiny_decoder_config(num_hidden_layers=1, position_embedding_type="relative_bias", num_labels=3),
        ["logits"],
    ),
    ("seq2seq", "feature-extraction"): (
        VaswaniForConditionalGeneration,  # its encoder alone
        lambda: tiny_seq2seq_config(position_embedding_type="sinusoidal", encoder_layers=1, decoder_layers=1),
        ["last_hidden_state"],
    ),
}


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """`exported(key)` -> (model, ExportResult) for a (kind, name) key: `("generation", position type)`,
    `("seq2seq", position type)`, `("task", (family, task))`, `("opset", opset)` or `("fp16", "rope")`."""
    results = {}

    def export(key):
        if key not in results:
            kind, name = key
            folder = tmp_path_factory.mktemp("onnx") / "export"
            if kind == "generation":
                shape, layers, options = GENERATION_CASES[name]
                config = tiny_decoder_config(
                    position_embedding_type=name,
                    num_key_value_heads=KV_HEADS[shape],
                    num_hidden_layers=layers,
                    **(LLAMA_STYLE if name == "rope" else {}),
                )
                model, task = build_model(VaswaniForCausalLM, config, "sdpa"), "text-generation"
            elif kind == "opset":  # a LLaMA-style decoder (rope, GQA) exported at opset `name`
                config = tiny_decoder_config(num_key_value_heads=KV_HEADS["gqa"], num_hidden_layers=1, **LLAMA_STYLE)
                model, task, options = build_model(VaswaniForCausalLM, config, "sdpa"), None, {"opset": name}
            elif kind == "fp16":
                config = tiny_decoder_config(position_embedding_type="rope", num_key_value_heads=2, num_hidden_layers=1)
                model, task, options = build_model(VaswaniForCausalLM, config, "sdpa"), None, {"dtype": "fp16"}
            elif kind == "seq2seq":
                shape, layers = SEQ2SEQ_CASES[name]
                config = tiny_seq2seq_config(
                    position_embedding_type=name,
                    num_key_value_heads=KV_HEADS[shape],
                    encoder_layers=1,
                    decoder_layers=layers,
                )
                model, task, options = build_model(VaswaniForConditionalGeneration, config, "sdpa"), None, {}
            else:
                model_class, make_config, _ = TASK_CASES[name]
                model, task, options = build_model(model_class, make_config(), "sdpa"), name[1], {}
            results[key] = model, export_onnx(model, folder, task, **options)
        return results[key]

    return export


# ------------------------------------------------------------------------------- the runtime and generation tests

PAD = 0
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()

# Exporting is the slow part, so each export covers several variants: a graph with position_ids (rope) and one
# without (alibi), grouped-query and multi-query attention, T5's relative bias with grouped-query cross-attention.
DECODERS = {
    "rope-gqa": dict(position_embedding_type="rope", num_key_value_heads=2),
    "alibi-mqa": dict(position_embedding_type="alibi", num_key_value_heads=1),
}
SEQ2SEQ = {"relative_bias-gqa": dict(position_embedding_type="relative_bias", num_key_value_heads=2)}
# Encoder heads whose runtime tests ask nothing of the model but its head: the validated exports of TASK_CASES (one
# position type each), so that a run of the whole suite exports each of these models once.
TASK_EXPORTS = {
    "sequence-classification": ("encoder", "text-classification"),
    "token-classification": ("encoder", "token-classification"),
    "feature-extraction": ("encoder", "feature-extraction"),
}


@pytest.fixture(scope="session")
def tokenizer():
    """The packaged corpus' byte-level BPE, plus the mask token fill-mask needs."""
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    tokenizer.add_special_tokens({"mask_token": "<mask>"})
    return tokenizer


@pytest.fixture(scope="session")
def exports(tmp_path_factory, tokenizer, exported):
    """name -> (PyTorch model, exported folder), exporting each tiny model on first use (TASK_EXPORTS: taken from
    `exported`)."""
    # The decoders cover the tokenizer's vocabulary, for the text-generation pipeline.
    recipes = {
        **{
            f"decoder-{name}": (
                VaswaniForCausalLM,
                tiny_decoder_config(vocab_size=len(tokenizer), **overrides),
                "text-generation",
            )
            for name, overrides in DECODERS.items()
        },
        **{
            f"seq2seq-{name}": (
                VaswaniForConditionalGeneration,
                tiny_seq2seq_config(**overrides),
                "text2text-generation",
            )
            for name, overrides in SEQ2SEQ.items()
        },
        # Segment embeddings make token_type_ids a graph input.
        "masked-lm": (
            VaswaniForMaskedLM,
            tiny_encoder_config(vocab_size=len(tokenizer), type_vocab_size=2),
            "fill-mask",
        ),
        # ONNX Runtime's CPU provider runs fp16 graphs too: the half-precision cache path is tested without a GPU.
        "decoder-fp16": (VaswaniForCausalLM, tiny_decoder_config(**DECODERS["rope-gqa"]), "text-generation", "fp16"),
    }
    done = {}

    def get(name: str):
        if name in TASK_EXPORTS and name not in done:
            model, result = exported(("task", TASK_EXPORTS[name]))
            done[name] = model, result.folder
        if name not in done:
            model_class, config, task, *dtype = recipes[name]
            model = build_model(model_class, config)
            folder = tmp_path_factory.mktemp(name)
            # validate=False: these tests compare with PyTorch themselves.
            export_onnx(model, folder, task=task, dtype=dtype[0] if dtype else "fp32", validate=False)
            done[name] = model, folder
        return done[name]

    return get


@pytest.fixture(scope="session")
def load(exports):
    """(ORT class, export name, **from_pretrained kwargs) -> (PyTorch model, ORT model); sessions use one thread,
    like the rest of the suite."""
    loaded = {}

    def get(ort_class, name: str, **kwargs):
        key = (ort_class, name, tuple(sorted(kwargs.items())))
        if key not in loaded:
            model, folder = exports(name)
            kwargs.setdefault("session_options", default_session_options(num_threads=1))
            loaded[key] = model, ort_class.from_pretrained(folder, **kwargs)
        return loaded[key]

    return get


def left_padded_prompts(lengths=(5, 3, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    mask = padding_mask(list(lengths), max(lengths), "left")
    return random_ids(len(lengths), max(lengths)).masked_fill(mask == 0, PAD), mask


def right_padded_sources(lengths=(9, 5, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    mask = padding_mask(list(lengths), max(lengths), "right")
    return random_ids(len(lengths), max(lengths), seed=1).masked_fill(mask == 0, PAD), mask
