"""Folder conversion (`convert_checkpoint`) and `vaswani convert`: transformers folders become vaswani folders and back,
with safetensors weights, the generation config and the tokenizer carried over; the written folder reproduces the
source model (checked here against the source, independently of the converter's own check). Bad input is refused
before anything is written, and a failure part-way leaves no folder behind."""

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import build_model
from safetensors import safe_open
from test_conversion_parity import TINY, native_model, tiny_bart, tiny_bert, tiny_decoder, tiny_t5
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BartForConditionalGeneration,
    BertConfig,
    BertForNextSentencePrediction,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedModel,
)

from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM, VaswaniPreTrainedModel
from vaswani.cli.main import main
from vaswani.conversion.checkpoints import PARITY_TOLERANCE, ParityError, convert_checkpoint
from vaswani.conversion.checkpoints import convert as checkpoint_convert
from vaswani.data.tokenization import corpus_tokenizer

VOCAB = 300  # the tiny tokenizer's vocabulary
TEXTS = ["Once upon a time, a fox found a key.", "The end."]


@pytest.fixture(scope="module")
def tokenizer():
    return corpus_tokenizer(vocab_size=VOCAB, kilobytes=20)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2, bos_token_id=0,
        eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def save(model: PreTrainedModel, folder: Path, tokenizer=None) -> Path:
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def gpt2_folder(tmp_path, tokenizer) -> Path:
    return save(tiny_gpt2(), tmp_path / "gpt2", tokenizer)


def assert_same_causal_lm(expected_model, actual_model, tokenizer) -> None:
    """Logits at every real token of a padded, tokenized batch, and greedy tokens, as an independent oracle."""
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch.attention_mask.min() == 0, "the batch should contain padding"
    with torch.no_grad():
        expected = expected_model(**batch).logits
        actual = actual_model(**batch).logits
    keep = batch.attention_mask.bool()
    assert expected.abs().max() > 1.0
    assert (actual[keep] - expected[keep]).abs().max() <= PARITY_TOLERANCE
    prompt = tokenizer(TEXTS[:1], return_tensors="pt")
    settings = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert (
        actual_model.generate(**prompt, **settings).tolist() == expected_model.generate(**prompt, **settings).tolist()
    )


def assert_same_tokenizer(folder: Path, tokenizer) -> None:
    copied = AutoTokenizer.from_pretrained(folder)
    assert [copied(text).input_ids for text in TEXTS] == [tokenizer(text).input_ids for text in TEXTS]
    assert (copied.eos_token, copied.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)


def weight_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.suffix in (".safetensors", ".bin", ".pt", ".pth"))


# ----------------------------------------------------------------------------------------------- conversion


def test_transformers_folder_becomes_a_vaswani_folder_with_its_tokenizer(gpt2_folder, tokenizer, tmp_path):
    target = convert_checkpoint(gpt2_folder, tmp_path / "vaswani")
    assert target == tmp_path / "vaswani"
    assert weight_files(target) == ["model.safetensors"]
    assert json.loads((target / "config.json").read_text())["model_type"] == "vaswani_decoder"
    assert json.loads((target / "generation_config.json").read_text())["pad_token_id"] == 1
    converted = AutoModelForCausalLM.from_pretrained(target)
    assert isinstance(converted, VaswaniForCausalLM)
    assert_same_causal_lm(tiny_gpt2(), converted, tokenizer)
    assert_same_tokenizer(target, tokenizer)


def test_vaswani_folder_becomes_the_inferred_transformers_architecture(tokenizer, tmp_path):
    config = VaswaniDecoderConfig.from_preset(
        "llama", **{**TINY, "vocab_size": VOCAB}, num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    model = build_model(VaswaniForCausalLM, config)
    source = save(model, tmp_path / "vaswani", tokenizer)
    target = convert_checkpoint(source, tmp_path / "llama", reverse="auto")
    assert weight_files(target) == ["model.safetensors"]
    converted = AutoModelForCausalLM.from_pretrained(target)
    assert isinstance(converted, LlamaForCausalLM)
    assert_same_causal_lm(model, converted, tokenizer)
    assert_same_tokenizer(target, tokenizer)


@pytest.mark.parametrize(
    "build",
    [
        lambda: tiny_t5("gated-gelu"),  # its own LM head: transformers' T5 config alone would tie it on reload
        lambda: tiny_bert(BertForSequenceClassification),
        lambda: tiny_bart(BartForConditionalGeneration, scale_embedding=True),
        lambda: tiny_decoder(LlamaForCausalLM),
    ],
    ids=["T5-gated-gelu", "BertForSequenceClassification", "BartForConditionalGeneration", "llama-gqa"],
)
def test_folder_round_trip_restores_identical_weights(build, tmp_path):
    reference = build()
    source = save(reference, tmp_path / "source")
    convert_checkpoint(source, tmp_path / "vaswani")
    convert_checkpoint(tmp_path / "vaswani", tmp_path / "back", reverse=reference.config.model_type)
    restored = type(reference).from_pretrained(tmp_path / "back")
    expected, actual = reference.state_dict(), restored.state_dict()
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected)


def test_half_precision_checkpoint_is_written_in_its_own_dtype(tmp_path):
    reference = tiny_decoder(LlamaForCausalLM).to(torch.bfloat16)
    target = convert_checkpoint(save(reference, tmp_path / "llama"), tmp_path / "vaswani")
    with safe_open(str(target / "model.safetensors"), framework="pt") as weights:
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, reference.model.embed_tokens.weight)


# ------------------------------------------------------------------------------------------------ bad input


def test_unsupported_architecture_is_refused_with_the_supported_ones_and_nothing_is_written(tmp_path):
    torch.manual_seed(0)
    opt = OPTForCausalLM(
        OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32)
    )
    source = save(opt, tmp_path / "opt")
    with pytest.raises(ValueError, match="model_type='opt'.*bart, bert, gpt2, llama, mistral, qwen2, t5"):
        convert_checkpoint(source, tmp_path / "out")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["opt"]


@pytest.mark.parametrize("case", ["unsupported_head", "vaswani_without_reverse", "reverse_of_transformers"])
def test_folders_that_cannot_convert_as_asked_are_refused_by_name(case, gpt2_folder, tmp_path):
    if case == "unsupported_head":
        config = BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
        source, reverse = save(BertForNextSentencePrediction(config), tmp_path / "nsp"), None
        expected = "BertForNextSentencePrediction has no vaswani equivalent. Supported classes: BartForConditional"
    elif case == "vaswani_without_reverse":
        source, reverse = save(native_model("gpt2"), tmp_path / "vaswani"), None
        expected = "holds a vaswani model .* pass reverse=ARCH"
    else:
        source, reverse = gpt2_folder, "gpt2"
        expected = "holds model_type='gpt2'; drop reverse"
    with pytest.raises(ValueError, match=expected):
        convert_checkpoint(source, tmp_path / "out", reverse=reverse)
    assert not (tmp_path / "out").exists()


def test_non_empty_target_is_left_untouched_unless_overwrite(gpt2_folder, tmp_path):
    target = tmp_path / "existing"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass overwrite=True"):
        convert_checkpoint(gpt2_folder, target)
    assert [path.name for path in target.iterdir()] == ["notes.txt"]
    convert_checkpoint(gpt2_folder, target, overwrite=True)
    assert not (target / "notes.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing", "gpt2"]  # no staging folders left


def test_failure_while_saving_leaves_no_folder_behind(gpt2_folder, tmp_path, monkeypatch):
    def save_half_then_fail(self, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(VaswaniPreTrainedModel, "save_pretrained", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(gpt2_folder, tmp_path / "new" / "nested" / "out")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpt2"]  # not even the parent folders it created


# ---------------------------------------------------------------------------------------------- command line


def test_cli_converts_both_ways_and_prints_the_parity_figures(gpt2_folder, tmp_path, capsys):
    assert main(["convert", "--from", str(gpt2_folder), "--to", str(tmp_path / "vaswani")]) == 0
    assert (
        main(["convert", "--from", str(tmp_path / "vaswani"), "--to", str(tmp_path / "back"), "--reverse", "gpt2"]) == 0
    )
    output = capsys.readouterr().out
    figures = re.findall(r"Parity: max abs diff (\S+) over logits .*; greedy generation identical", output)
    assert len(figures) == 2 and all(float(figure) <= PARITY_TOLERANCE for figure in figures), output
    assert "Tokenizer: copied" in output and f"Wrote {tmp_path / 'back'}" in output
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "back"), GPT2LMHeadModel)


def test_cli_exits_1_when_the_converted_model_does_not_reproduce_the_source(gpt2_folder, tmp_path, monkeypatch, capsys):
    convert = checkpoint_convert.from_transformers

    def convert_wrongly(model):
        converted = convert(model)
        with torch.no_grad():
            converted.model.layers[0].mlp.up_proj.weight.mul_(1.5)
        return converted

    monkeypatch.setattr(checkpoint_convert, "from_transformers", convert_wrongly)
    assert main(["convert", "--from", str(gpt2_folder), "--to", str(tmp_path / "out")]) == 1
    assert "does not reproduce" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ParityError):
        convert_checkpoint(gpt2_folder, tmp_path / "out")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--from", "{tmp}/missing", "--to", "{tmp}/out"], "does not exist"),
        (["--from", "{tmp}/gpt2", "--to", "{tmp}/gpt2"], "is the source folder"),
        (["--from", "{tmp}/gpt2", "--to", "{tmp}/out", "--reverse", "llama"], "drop reverse"),
    ],
    ids=["missing_source", "target_is_source", "reverse_of_a_transformers_folder"],
)
def test_cli_exits_2_on_bad_input(arguments, message, gpt2_folder, tmp_path, capsys):
    assert main(["convert", *(argument.format(tmp=tmp_path) for argument in arguments)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--from", "somewhere"])
    assert exit_info.value.code == 2
    assert "--to" in capsys.readouterr().err
