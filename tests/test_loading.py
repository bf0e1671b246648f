"""`vaswani.runtime.loading.load_folder`: every form (PyTorch, ONNX export) and task (causal LM, masked LM, encoder-decoder)
loads as its class with the folder's tokenizer, and folders it cannot serve give the errors it states."""

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
from conftest import build_model, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from vaswani import VaswaniDecoderModel, VaswaniForConditionalGeneration, VaswaniForMaskedLM
from vaswani.runtime.loading import folder_task, load_folder

pytest.importorskip("onnxruntime")
from vaswani.export import export_onnx  # noqa: E402

# name: (model class, config, export task); the causal LM is the session's tiny chat pair (conftest.tiny_chat_pair).
# One layer per stack: loading does not depend on depth, and tracing time grows with it.
SOURCES = {
    "masked": (VaswaniForMaskedLM, partial(tiny_encoder_config, num_hidden_layers=1), "fill-mask"),
    "seq2seq": (
        VaswaniForConditionalGeneration,
        partial(tiny_seq2seq_config, encoder_layers=1, decoder_layers=1),
        "text2text-generation",
    ),
}
EXPECTED = [
    ("causal", "pytorch", "VaswaniForCausalLM", "text-generation"),
    ("masked", "pytorch", "VaswaniForMaskedLM", "fill-mask"),
    ("seq2seq", "pytorch", "VaswaniForConditionalGeneration", "text2text-generation"),
    ("llama", "pytorch", "LlamaForCausalLM", "text-generation"),
    ("causal", "onnx", "OrtModelForCausalLM", "text-generation"),
    ("masked", "onnx", "OrtModelForMaskedLM", "fill-mask"),
    ("seq2seq", "onnx", "OrtModelForSeq2SeqLM", "text2text-generation"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tiny_chat_pair: dict[str, Path]) -> dict[tuple[str, str], Path]:
    """(name, form) -> folder: each vaswani model saved with a tokenizer and exported, and a transformers LLaMA."""
    root = tmp_path_factory.mktemp("loading")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_pair["pytorch"])
    folders = {("causal", form): folder for form, folder in tiny_chat_pair.items()}
    for name, (model_class, config, task) in SOURCES.items():
        folder = folders[name, "pytorch"] = root / f"{name}-pt"
        build_model(model_class, config(vocab_size=len(tokenizer))).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name, "onnx"] = root / f"{name}-onnx"
        export_onnx(folder, folders[name, "onnx"], task=task, validate=False)
    llama = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    folders["llama", "pytorch"] = root / "llama-pt"
    LlamaForCausalLM(llama).save_pretrained(folders["llama", "pytorch"])
    tokenizer.save_pretrained(folders["llama", "pytorch"])
    return folders


@pytest.mark.parametrize("name, form, class_name, task", EXPECTED, ids=[f"{n}-{f}" for n, f, *_ in EXPECTED])
def test_each_form_and_task_loads_as_its_class(folders, name: str, form: str, class_name: str, task: str) -> None:
    folder = folders[name, form]
    loaded = load_folder(folder)
    assert type(loaded.model).__name__ == class_name
    assert (loaded.task, loaded.form, loaded.folder) == (task, form, folder)
    assert folder_task(folder) == task
    assert loaded.tokenizer.chat_template is not None and len(loaded.tokenizer) == loaded.model.config.vocab_size
    if form == "pytorch":
        assert not loaded.model.training
    assert load_folder(folder, task=task).task == task  # the task it does is accepted


def test_onnx_threads_reach_the_session(folders) -> None:
    loaded = load_folder(folders["causal", "onnx"], threads=1)
    for graph in loaded.model.graphs.values():
        assert graph.session.get_session_options().intra_op_num_threads == 1


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"is not a model folder \(no config.json\).*save_pretrained"):
        load_folder(tmp_path)


def test_bare_model_folder_is_refused(tmp_path: Path) -> None:
    build_model(VaswaniDecoderModel, tiny_decoder_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="holds a VaswaniDecoderModel model, which has no language-modelling head"):
        load_folder(tmp_path)


def test_export_without_language_modelling_head_is_refused(folders, tmp_path: Path) -> None:
    # An export's task is its manifest's: a feature-extraction export's, with the graphs left out (never loaded).
    manifest = json.loads((folders["masked", "onnx"] / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "task": "feature-extraction"}))
    shutil.copy(folders["masked", "onnx"] / "config.json", tmp_path)
    with pytest.raises(ValueError, match="'feature-extraction' export, which has no language-modelling head"):
        load_folder(tmp_path)


@pytest.mark.parametrize("form", ["pytorch", "onnx"])
def test_wrong_task_is_refused(folders, form: str) -> None:
    with pytest.raises(ValueError, match="holds a 'fill-mask' model; this needs a 'text-generation' one"):
        load_folder(folders["masked", form], task="text-generation")
