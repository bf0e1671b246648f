"""`export_onnx` and `vaswani export` on a transformers folder: converted in memory (weights shared, nothing
written but the export) and checked against the transformers model on a left-padded batch, then exported to the
same graphs, byte for byte, as `vaswani convert` followed by `vaswani export`, with the same tokenizer and generation
config beside them. Encoders and encoder-decoders export the same way and still compute what transformers does;
an unsupported architecture, or a conversion that does not reproduce its source, is refused before the export.
"""

import contextlib
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import padding_mask, random_ids
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    BertConfig,
    BertForMaskedLM,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

pytest.importorskip("onnxruntime")

from vaswani.cli.main import main  # noqa: E402
from vaswani.conversion.checkpoints import PARITY_TOLERANCE, ParityError, convert_checkpoint  # noqa: E402
from vaswani.conversion.checkpoints import convert as checkpoint_folders  # noqa: E402
from vaswani.data.tokenization import train_tokenizer  # noqa: E402
from vaswani.export import export_onnx, trace_onnx  # noqa: E402
from vaswani.runtime import (  # noqa: E402
    OrtModelForMaskedLM,
    OrtModelForSeq2SeqLM,
    load_manifest,  # noqa: E402
)

VOCAB = 300
CORPUS = ["Once upon a time, a fox found a key.", "The end of the story, said the fox to the owl."] * 20
QUANTIZE = {"fp32": [], "int8": ["--quantize", "int8"]}
# Written by the two-command path's save_pretrained only: remote-code pointers (to model code that neither ONNX
# folder carries) and the dtype the intermediate checkpoint was saved in.
INTERMEDIATE_CONFIG_FIELDS = ("auto_map", "dtype")


def tiny_llama() -> LlamaForCausalLM:
    """SmolLM2's shape in miniature: grouped-query attention, a tied LM head, and more layers than the two that the
    export traces before stamping the rest; head_dim 16, which ONNX Runtime's GroupQueryAttention accepts."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_bart() -> BartForConditionalGeneration:
    """One layer per side (tracing time grows with depth), scaled embeddings and a wide init, so that generation
    does not repeat one token."""
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        scale_embedding=True, init_std=0.2,
    )  # fmt: skip
    return BartForConditionalGeneration(config).eval()


def tiny_bert() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, initializer_range=0.2,
    )  # fmt: skip
    return BertForMaskedLM(config).eval()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A transformers folder as `save_pretrained` writes it: weights, config, generation config and a tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "llama"
    tiny_llama().save_pretrained(folder)
    train_tokenizer(CORPUS, vocab_size=VOCAB, save_directory=folder)
    return folder


@pytest.fixture(scope="module")
def cli_exports(llama_folder, tmp_path_factory) -> dict[str, tuple[Path, str, str]]:
    """`vaswani export --model <transformers folder>` in fp32 and int8, each into a folder of its own: the output
    folder, and what the command printed to stdout and stderr."""
    exports = {}
    for precision, options in QUANTIZE.items():
        output = tmp_path_factory.mktemp(f"one-process-{precision}") / "onnx"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["export", "--model", str(llama_folder), "--output", str(output), *options])
        assert code == 0, err.getvalue()
        exports[precision] = output, out.getvalue(), err.getvalue()
    return exports


@pytest.fixture(scope="module")
def two_command_exports(llama_folder, tmp_path_factory) -> dict[str, Path]:
    """The same exports the two-step way: `vaswani convert` to a vaswani folder, then the export of that folder
    (not validated again: only its graphs are compared)."""
    root = tmp_path_factory.mktemp("two-commands")
    convert_checkpoint(llama_folder, root / "vaswani")
    with trace_onnx(root / "vaswani") as traced:  # one trace, both precisions
        return {
            precision: traced.export(root / precision, quantize="int8" if options else None, validate=False).folder
            for precision, options in QUANTIZE.items()
        }


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------- same export, one process


@pytest.mark.parametrize("precision", list(QUANTIZE))
def test_one_process_export_writes_the_two_command_graphs_byte_for_byte(precision, cli_exports, two_command_exports):
    one_process, two_commands = files(cli_exports[precision][0]), files(two_command_exports[precision])
    assert one_process.keys() == two_commands.keys()
    assert one_process["model.onnx"] == two_commands["model.onnx"]
    assert one_process["model.onnx.data"] == two_commands["model.onnx.data"]
    # The tokenizer and generation config are carried over as `vaswani convert` carries them.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert one_process[name] == two_commands[name], name
    configs = [json.loads(folder["config.json"]) for folder in (one_process, two_commands)]
    for field in INTERMEDIATE_CONFIG_FIELDS:
        configs[1].pop(field, None)
    assert configs[0] == configs[1]
    manifests = [load_manifest(export) for export in (cli_exports[precision][0], two_command_exports[precision])]
    manifests[0].pop("validation")
    manifests[0].get("portable_form", {}).pop("validation", None)  # the portable graph's own report
    assert manifests[0] == manifests[1]
    for name in ("model_portable.onnx", "model_portable.onnx.data"):  # the GroupQueryAttention form's companion
        assert one_process.get(name) == two_commands.get(name), name
    if precision == "int8":
        assert manifests[0]["attention_form"] == "gqa"  # SmolLM2's quantized form: GroupQueryAttention


def test_cli_prints_the_conversion_and_its_parity_check_and_writes_nothing_else(cli_exports, llama_folder):
    output, out, err = cli_exports["fp32"]
    assert f"Loading LlamaForCausalLM from {llama_folder}" in err
    assert "Converted to VaswaniForCausalLM (vaswani_decoder) in memory, sharing its weights" in err
    parity = re.search(r"Parity: max abs diff (\S+) over logits on a left-padded batch", err)
    assert parity and float(parity.group(1)) <= PARITY_TOLERANCE, err
    assert "Tokenizer: copied" in err and f"Wrote {output}" in err
    assert "| model | logits |" in out  # the validation table ends the output
    # No intermediate vaswani folder or safetensors, beside the export or in the source folder.
    assert [path.name for path in output.parent.iterdir()] == ["onnx"]
    assert sorted(path.name for path in llama_folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_converted_model_shares_the_transformers_weights(llama_folder, monkeypatch):
    pairs = []
    convert = checkpoint_folders.from_transformers

    def record(model, **options):
        pairs.append((model, convert(model, **options)))
        return pairs[-1][1]

    monkeypatch.setattr(checkpoint_folders, "from_transformers", record)
    converted = checkpoint_folders.load_converted(llama_folder, log=lambda line: None)
    [(source, recorded)] = pairs
    assert recorded is converted
    source_storage = {parameter.data_ptr() for parameter in source.parameters()}
    assert all(parameter.data_ptr() in source_storage for parameter in converted.parameters())
    assert converted.lm_head.weight is converted.model.embed_tokens.weight  # still tied after sharing
    assert converted.config.architectures == ["VaswaniForCausalLM"]


# ------------------------------------------------------------------------------- other families, one process


def test_bart_source_exports_text2text_generation_that_generates_transformers_tokens(tmp_path):
    reference = tiny_bart()
    reference.save_pretrained(tmp_path / "bart")
    lines = []
    result = export_onnx(tmp_path / "bart", tmp_path / "onnx", progress=lines.append)
    assert any(line.startswith("Parity: max abs diff 0 over logits, encoder_last_hidden_state") for line in lines)
    assert result.manifest["task"] == "text2text-generation" and result.validation.passed
    source, mask = random_ids(2, 7, vocab_size=64), padding_mask([7, 4], 7, "left")
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1, eos_token_id=None)
    expected = reference.generate(source, **settings)
    actual = OrtModelForSeq2SeqLM.from_pretrained(result.folder).generate(source, **settings)
    assert actual.tolist() == expected.tolist()


def test_bert_source_exports_fill_mask_with_the_transformers_logits(tmp_path):
    reference = tiny_bert()
    reference.save_pretrained(tmp_path / "bert")
    result = export_onnx(tmp_path / "bert", tmp_path / "onnx")
    assert result.manifest["task"] == "fill-mask" and result.validation.passed
    input_ids, mask = random_ids(2, 9, vocab_size=64), padding_mask([9, 5], 9, "right")
    with torch.no_grad():
        expected = reference(input_ids, attention_mask=mask).logits
    actual = OrtModelForMaskedLM.from_pretrained(result.folder)(input_ids, attention_mask=mask).logits
    keep = mask.bool().numpy()
    assert expected.abs().max() > 1.0
    np.testing.assert_allclose(np.asarray(actual)[keep], expected.numpy()[keep], atol=PARITY_TOLERANCE)


# ------------------------------------------------------------------------------------------------- refusals


def test_unsupported_architecture_is_refused_with_the_supported_ones(tmp_path, capsys):
    torch.manual_seed(0)
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    opt.save_pretrained(tmp_path / "opt")
    supported = (
        "model_type='opt' is not supported. Supported architectures: bart, bert, gpt2, llama, mistral, qwen2, t5"
    )
    with pytest.raises(ValueError, match=re.escape(supported)):
        export_onnx(tmp_path / "opt", tmp_path / "onnx")
    assert main(["export", "--model", str(tmp_path / "opt"), "--output", str(tmp_path / "onnx")]) == 2
    assert supported in capsys.readouterr().err
    assert [path.name for path in tmp_path.iterdir()] == ["opt"]


def test_cli_exits_1_when_the_conversion_does_not_reproduce_the_source(llama_folder, tmp_path, monkeypatch, capsys):
    convert = checkpoint_folders.from_transformers

    def convert_wrongly(model, **options):
        converted = convert(model, **options)
        up_proj = converted.model.layers[0].mlp.up_proj
        # A new tensor: scaling the shared one in place would change the source model too, and parity would hold.
        up_proj.weight = torch.nn.Parameter(up_proj.weight.detach() * 1.5)
        return converted

    monkeypatch.setattr(checkpoint_folders, "from_transformers", convert_wrongly)
    assert main(["export", "--model", str(llama_folder), "--output", str(tmp_path / "onnx")]) == 1
    assert "does not reproduce" in capsys.readouterr().err
    with pytest.raises(ParityError, match="on a left-padded batch"):
        export_onnx(llama_folder, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


# ----------------------------------------------------------------------------------------------- fast exit


def test_console_script_ends_an_export_without_interpreter_teardown(tmp_path, monkeypatch, capsys):
    exits = []

    def record_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", record_exit)
    arguments = ["export", "--model", str(tmp_path / "missing"), "--output", str(tmp_path / "onnx")]
    assert main(arguments) == 2 and exits == []  # called from Python: returns, as every command does
    monkeypatch.setattr("sys.argv", ["vaswani", *arguments])
    with pytest.raises(SystemExit):
        main()  # as the console script: leaves at once, output flushed
    assert exits == [2]
    assert capsys.readouterr().err.count("has no config.json") == 2
