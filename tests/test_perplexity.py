"""`vaswani.evaluation.perplexity` and `vaswani perplexity`: the strided-window perplexity equals transformers' own loss and a
naive per-token loop, an ONNX export agrees with its PyTorch model for every task, and bad input gets clear errors.
"""

import json
import math
import shutil

import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # the exporter's dependency

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vaswani.cli.main import main  # noqa: E402
from vaswani.evaluation.perplexity import folder_perplexity, model_perplexity, strided_windows, summed_nll  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM, OrtModelForMaskedLM, OrtModelForSeq2SeqLM  # noqa: E402

pytest_plugins = ["onnx_cases"]  # the shared `tokenizer`, `exports` and `load` fixtures

TEXT = (
    "Once upon a time there was a little fox who lived in the forest. Every morning the fox ran to the river to "
    "drink, and every evening it told the owl what it had seen. One day the river was gone."
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer):
    """A transformers LLaMA with random tiny weights, saved with the corpus tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def token_ids(tokenizer) -> torch.Tensor:
    return torch.tensor(tokenizer(TEXT, add_special_tokens=False)["input_ids"])


def test_strided_windows_score_every_token_with_left_context_once():
    for length, context, stride in [(10, 4, 2), (10, 4, 4), (11, 4, 3), (3, 8, 8), (9, 5, 1), (13, 4, 4)]:
        windows = strided_windows(length, context, stride)
        scored = [position for _, end, first in windows for position in range(first, end)]
        # Consecutive windows (stride == context) cannot score their first token: it has no context inside them.
        unreachable = set(range(context, length, context)) if stride == context else set()
        assert scored == sorted(set(range(1, length)) - unreachable)
        assert all(end - start <= context and start < first for start, end, first in windows)


def test_full_context_equals_transformers_loss(llama_folder, tokenizer):
    ids = token_ids(tokenizer)
    result = folder_perplexity(llama_folder, TEXT, context=len(ids), stride=len(ids))
    model = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    with torch.no_grad():
        loss = model(ids[None], labels=ids[None]).loss.item()
    assert result.tokens == len(ids) - 1
    assert result.perplexity == pytest.approx(math.exp(loss), rel=1e-5)
    assert (result.task, result.form, result.context) == ("text-generation", "pytorch", len(ids))


def test_strided_windows_equal_a_naive_per_token_loop(llama_folder, tokenizer):
    ids = token_ids(tokenizer)[:40]
    model = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    context, stride = 12, 5
    # The oracle: each position t is predicted from the window of its scoring, which starts at the last multiple of
    # the stride whose window still reaches t (the first window reaches up to `context`).
    nlls = []
    with torch.no_grad():
        for position in range(1, len(ids)):
            start = 0 if position < context else (position - context) // stride * stride + stride
            while start + context <= position:
                start += stride
            log_probs = model(ids[None, start:position]).logits[0, -1].log_softmax(-1)
            nlls.append(-log_probs[ids[position]].item())
    total, count = summed_nll(model, ids, "text-generation", context, stride)
    assert count == len(nlls)
    assert total == pytest.approx(sum(nlls), rel=1e-5)


@pytest.mark.parametrize(
    "ort_class, name",
    [
        (OrtModelForCausalLM, "decoder-rope-gqa"),
        (OrtModelForMaskedLM, "masked-lm"),
        (OrtModelForSeq2SeqLM, "seq2seq-relative_bias-gqa"),
    ],
)
def test_onnx_export_agrees_with_pytorch(load, tokenizer, ort_class, name):
    model, ort_model = load(ort_class, name)
    task = {OrtModelForCausalLM: "text-generation", OrtModelForMaskedLM: "fill-mask"}.get(
        ort_class, "text2text-generation"
    )
    vocab = model.config.vocab_size
    texts = [TEXT, TEXT.upper()]
    # The seq2seq model's vocabulary is smaller than the tokenizer's: score ids it knows.
    if vocab < len(tokenizer):
        texts = None
    stride = 8 if task == "text-generation" else 16
    if texts is None:
        ids = token_ids(tokenizer) % vocab
        expected = summed_nll(model, ids, task, 16, stride, tokenizer.mask_token_id)
        actual = summed_nll(ort_model, ids, task, 16, stride, tokenizer.mask_token_id)
        assert actual[1] == expected[1] > 0
        assert actual[0] == pytest.approx(expected[0], rel=1e-4)
        return
    expected = model_perplexity(model, tokenizer, texts, task, "pytorch", context=16, stride=stride)
    # The export scores full windows in batches (as benchmarks/benchmark_onnx.py runs it); PyTorch one at a time.
    actual = model_perplexity(ort_model, tokenizer, texts, task, "onnx", context=16, stride=stride, batch_tokens=64)
    assert actual.tokens == expected.tokens > 0
    assert actual.perplexity == pytest.approx(expected.perplexity, rel=1e-4)


def test_masked_positions_are_the_same_on_every_call(load, tokenizer):
    model, _ = load(OrtModelForMaskedLM, "masked-lm")
    ids = token_ids(tokenizer)
    first = summed_nll(model, ids, "fill-mask", 16, mask_token_id=tokenizer.mask_token_id)
    again = summed_nll(model, ids, "fill-mask", 16, mask_token_id=tokenizer.mask_token_id)
    other_seed = summed_nll(model, ids, "fill-mask", 16, mask_token_id=tokenizer.mask_token_id, seed=1)
    assert first == again
    assert first != other_seed


def test_command_prints_and_writes_what_the_function_returns(llama_folder, tmp_path, capsys):
    text_file = tmp_path / "story.txt"
    text_file.write_text(TEXT)
    written = tmp_path / "ppl.json"
    argv = ["perplexity", str(llama_folder), "--text", str(text_file), "--context", "16", "--stride", "8"]
    assert main([*argv, "--max-tokens", "30", "--json", str(written)]) == 0
    expected = folder_perplexity(llama_folder, TEXT, context=16, stride=8, max_tokens=30)
    assert capsys.readouterr().out.strip() == expected.describe()
    report = json.loads(written.read_text())
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert (report["tokens"], report["context"], report["stride"], report["form"]) == (29, 16, 8, "pytorch")


@pytest.mark.parametrize(
    "extra, text, message",
    [
        ([], None, "no such file"),
        ([], "   \n", "is empty"),
        (["--context", "8", "--stride", "16"], TEXT, "larger than --context"),
        (["--context", "4096"], TEXT, "longer than the model's 128 positions"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(llama_folder, tmp_path, capsys, extra, text, message):
    text_file = tmp_path / "story.txt"
    if text is not None:
        text_file.write_text(text)
    with pytest.raises(SystemExit) as raised:
        main(["perplexity", str(llama_folder), "--text", str(text_file), *extra])
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_tools_score_the_same_windows_as_vaswani_perplexity(llama_folder, tokenizer, monkeypatch):
    # benchmarks/engine_perplexity.py cuts the windows; engines/windows.py scores an engine's logits.
    from benchmarks.engine_perplexity import engine_windows
    from benchmarks.engines.windows import Total, request_windows

    model = LlamaForCausalLM.from_pretrained(llama_folder).eval()
    ids = token_ids(tokenizer).tolist()
    total = Total()
    with torch.no_grad():
        for window, scored_from in request_windows({"windows": engine_windows(ids, 12, 5)}):
            total.add(model(torch.tensor([window])).logits[0].numpy(), window, scored_from)
    expected_total, expected_count = summed_nll(model, ids, "text-generation", 12, 5)
    assert total.result()["tokens"] == expected_count
    assert total.result()["mean_nll"] == pytest.approx(expected_total / expected_count, rel=1e-6)


def test_command_on_an_onnx_folder_agrees_with_its_pytorch_folder(exports, tokenizer, tmp_path, capsys):
    model, exported = exports("decoder-rope-gqa")
    onnx_folder, torch_folder = tmp_path / "onnx", tmp_path / "pytorch"
    shutil.copytree(exported, onnx_folder)
    model.save_pretrained(torch_folder)
    for folder in (onnx_folder, torch_folder):
        tokenizer.save_pretrained(folder)
    text_file = tmp_path / "story.txt"
    text_file.write_text(TEXT)
    reports = {}
    for folder in (onnx_folder, torch_folder):
        written = tmp_path / f"{folder.name}.json"
        argv = ["perplexity", str(folder), "--text", str(text_file), "--context", "16", "--stride", "8"]
        assert main([*argv, "--threads", "1", "--json", str(written)]) == 0
        reports[folder.name] = json.loads(written.read_text())
    assert reports["onnx"]["form"] == "onnx" and reports["pytorch"]["form"] == "pytorch"
    assert reports["onnx"]["tokens"] == reports["pytorch"]["tokens"] > 0
    assert reports["onnx"]["perplexity"] == pytest.approx(reports["pytorch"]["perplexity"], rel=1e-4)
