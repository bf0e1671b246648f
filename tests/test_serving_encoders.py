"""`vaswani serve` on encoder exports: /v1/embeddings (mean-pooled, L2-normalized) and /v1/classifications, checked
against the PyTorch model the folder was exported from; and the `vaswani serve` command's errors."""

import httpx
import pytest
import torch
from conftest import build_model, tiny_encoder_config
from serving_cases import serving, tiny_chat_tokenizer

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from vaswani import VaswaniEncoderForSequenceClassification, VaswaniEncoderModel  # noqa: E402
from vaswani.cli.main import main  # noqa: E402
from vaswani.export import export_onnx  # noqa: E402
from vaswani.serving import create_app, load_service  # noqa: E402

TEXTS = ["The cat sat on the mat.", "A dog ran in the park with a red ball.", "Hi"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


def exported(root, tokenizer, model_class, task, **overrides):
    config = tiny_encoder_config(vocab_size=len(tokenizer), num_hidden_layers=1, **overrides)
    model = build_model(model_class, config, "sdpa")
    model.save_pretrained(root / "pt")
    tokenizer.save_pretrained(root / "pt")
    export_onnx(root / "pt", root / "onnx", task=task, validate=False)
    return model, root / "onnx"


def padded(tokenizer, texts):
    rows = [tokenizer(text)["input_ids"] for text in texts]
    longest = max(map(len, rows))
    ids = torch.tensor([row + [0] * (longest - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in rows])
    return ids, mask


def test_embeddings_are_the_normalized_mean_of_the_encoders_hidden_states(tmp_path, tokenizer):
    model, folder = exported(tmp_path, tokenizer, VaswaniEncoderModel, "feature-extraction")
    ids, mask = padded(tokenizer, TEXTS)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    expected = torch.nn.functional.normalize((hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)
    with serving(create_app(load_service(folder, threads=1, name="tiny-encoder"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        reply = client.embeddings.create(model="tiny-encoder", input=TEXTS)
        single = client.embeddings.create(model="tiny-encoder", input=TEXTS[2])
        as_floats = httpx.post(server.url + "/v1/embeddings", json={"model": "tiny-encoder", "input": TEXTS}).json()
        chat = client.with_options(max_retries=0).chat.completions
        with pytest.raises(openai.BadRequestError, match="encoder"):
            chat.create(model="tiny-encoder", messages=[{"role": "user", "content": "Hi"}])
    served = torch.tensor([item.embedding for item in reply.data])
    assert torch.allclose(served, expected, atol=1e-4)  # the client's default, base64
    assert torch.allclose(torch.tensor([item["embedding"] for item in as_floats["data"]]), expected, atol=1e-4)
    assert torch.allclose(torch.tensor(single.data[0].embedding), expected[2], atol=1e-4)  # no padding: the same
    assert reply.usage.prompt_tokens == int(mask.sum())


def test_classifications_are_the_softmax_of_the_classifiers_logits(tmp_path, tokenizer):
    model, folder = exported(
        tmp_path,
        tokenizer,
        VaswaniEncoderForSequenceClassification,
        "text-classification",
        num_labels=3,
        id2label=LABELS,
        label2id={label: i for i, label in LABELS.items()},
        classifier_pooling="mean",
    )
    ids, mask = padded(tokenizer, TEXTS)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits.softmax(-1)
    with serving(create_app(load_service(folder, threads=1, name="tiny-classifier"))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        reply = client.post("/classifications", body={"model": "tiny-classifier", "input": TEXTS}, cast_to=object)
    for row, item in zip(expected, reply["data"]):
        assert item["label"] == LABELS[int(row.argmax())]
        assert torch.allclose(torch.tensor([item["scores"][LABELS[i]] for i in range(3)]), row, atol=1e-4)


def test_serve_command_rejects_what_it_cannot_serve(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "not a model folder" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--backend", "onnx"]) == 2  # an empty folder
    assert "config.json" in capsys.readouterr().err
