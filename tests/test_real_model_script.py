"""benchmarks/real_model.py runs the whole path on a locally built deep LLaMA chat checkpoint (24 layers, GQA, tied
embeddings, a chat template): convert -> parity -> chat generation -> ONNX export with default options (fp32 and
int8) -> ONNX Runtime generation -> perplexity, and writes its table. Converted and exported models chat through
`apply_chat_template` + `generate` and through the text-generation pipeline with messages, with PyTorch's tokens.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, pipeline

pytest.importorskip("onnxruntime")

from test_textbook_tasks import load_script  # noqa: E402

from vaswani.data import corpus_stories  # noqa: E402
from vaswani.data.tokenization import train_tokenizer  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402

# ChatML, as SmolLM2 and Qwen2 use.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Tell me about the little cat."}]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    """A 24-layer LLaMA with a chat template, saved as transformers would; wide init for decisive greedy tokens."""
    folder = tmp_path_factory.mktemp("checkpoint") / "llama-chat"
    tokenizer = train_tokenizer(corpus_stories()[:300], vocab_size=320)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATE
    tokenizer.eos_token = "<|im_end|>"
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=24, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def script_run(chat_checkpoint, tmp_path_factory):
    text = tmp_path_factory.mktemp("text") / "held_out.txt"
    text.write_text("\n\n".join(corpus_stories()[-20:]), encoding="utf-8")
    output = tmp_path_factory.mktemp("run")
    script = load_script("real_model")
    arguments = ["--model", str(chat_checkpoint), "--text", str(text), "--output", str(output)]
    rows = script.run(script.parse_args([*arguments, "--formats", "fp32", "int8", "--new-tokens", "8", "--max-tokens", "300"]))
    return output, rows


@pytest.mark.slow  # the deep (24-layer) real-model path, kept deep
def test_the_script_runs_the_whole_path_and_writes_its_table(script_run):
    output, rows = script_run
    systems = [row["system"] for row in rows]
    assert systems == ["transformers (source)", "vaswani PyTorch fp32", "vaswani ONNX Runtime fp32", "vaswani ONNX Runtime int8"]
    by_system = {row["system"]: row for row in rows}
    assert by_system["vaswani PyTorch fp32"]["same_tokens"]  # conversion: the source's greedy tokens
    assert by_system["vaswani ONNX Runtime fp32"]["same_tokens"]  # the 24-layer export validated with defaults
    reference = by_system["vaswani PyTorch fp32"]["perplexity"]
    assert by_system["vaswani ONNX Runtime fp32"]["perplexity"] == pytest.approx(reference, rel=1e-4)
    assert by_system["vaswani ONNX Runtime int8"]["megabytes"] < by_system["vaswani ONNX Runtime fp32"]["megabytes"]
    report = json.loads((output / "results.json").read_text())
    assert report["layers"] == 24 and report["task"] == "text-generation"
    table = (output / "results.md").read_text()
    assert table.count("\n| ") == len(rows) + 1 and "vaswani ONNX Runtime int8" in table


@pytest.mark.slow  # the deep (24-layer) real-model path, kept deep
def test_converted_and_exported_models_chat_with_pytorchs_tokens(script_run):
    output, _ = script_run
    script = load_script("real_model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output / "vaswani")
    models = {
        "pytorch": AutoModelForCausalLM.from_pretrained(output / "vaswani").eval(),
        "onnx": OrtModelForCausalLM.from_pretrained(output / "onnx-fp32"),
    }
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = {name: script.greedy(model, inputs, 8)[0] for name, model in models.items()}
    assert generated["onnx"] == generated["pytorch"]
    replies = {
        name: pipeline("text-generation", model=model, tokenizer=tokenizer)(MESSAGES, max_new_tokens=8, do_sample=False)
        for name, model in models.items()
    }
    for name, reply in replies.items():
        turns = reply[0]["generated_text"]
        assert turns[:-1] == MESSAGES and turns[-1]["role"] == "assistant", name
    assert replies["onnx"][0]["generated_text"][-1] == replies["pytorch"][0]["generated_text"][-1]
