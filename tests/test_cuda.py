"""The CUDA paths, where a GPU is present (every test here skips cleanly without one; CI has none).

- PyTorch's attention backends in bf16 (sdpa, flex_attention, and flash_attention_2 where its wheel is installed)
  for every position type each supports, decoder and encoder-decoder.
- A bf16 `Trainer` run on the GPU.
- `generate` with a static cache, which transformers compiles on CUDA.
- The commands on `--device cuda`: `vaswani serve` (the fp16 ONNX export on ONNX Runtime's CUDA provider, and the
  PyTorch backend) answering 16 concurrent chats; `vaswani chat`, `perplexity` and `bench`.

Oracles: eager attention in float32 (a backend's bf16 error must be of the size of eager's own bf16 error, where a
dropped position bias or a wrong mask would be far larger); uncompiled `generate` with a dynamic cache; offline greedy
`generate` of the same folder, one prompt at a time; the PyTorch folder's perplexity on the CPU in float32.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import POSITION_TYPES, build_model, padding_mask, random_ids, tiny_decoder_config, tiny_seq2seq_config
from serving_cases import QUESTIONS, free_port, tiny_chat_tokenizer, tiny_gqa_chat_folder, wait_for
from transformers.utils import is_flash_attn_2_available

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration
from vaswani.modeling.positions import bias_free_position_types

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BIAS_FREE_POSITION_TYPES = bias_free_position_types()

# head_dim 32: a size every fused kernel takes (flash and flex want multiples of 8 and 16).
CUDA_SHAPE = dict(
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=256,
)
LENGTH = 48
FUSED_BACKENDS = ["sdpa", "flex_attention"] + (["flash_attention_2"] if is_flash_attn_2_available() else [])
NEW_TOKENS = 24


def backend_cases(backends: list[str]) -> list[tuple[str, str]]:
    """(position type, backend) pairs a backend can run: flash attention takes no additive position bias."""
    return [
        (kind, backend)
        for backend in backends
        for kind in POSITION_TYPES
        if backend != "flash_attention_2" or kind in BIAS_FREE_POSITION_TYPES
    ]


def mixed_padding_mask() -> torch.Tensor:
    """A full row, a left-padded and a right-padded one."""
    return torch.cat([padding_mask([LENGTH, 30], LENGTH, "left"), padding_mask([20], LENGTH, "right")])


def logits_errors(model, backend: str, run) -> tuple[float, float]:
    """(largest error of eager in bf16, largest error of `backend` in bf16) against eager in float32, over the real
    tokens' logits; `run(model)` returns (logits, mask)."""
    reference = model.cuda()
    with torch.no_grad():
        exact, mask = run(reference)
        keep = mask.bool()
        errors = []
        for name in ("eager", backend):
            twin = type(model)._from_config(model.config, attn_implementation=name)
            twin.load_state_dict(reference.state_dict())
            twin = twin.to("cuda", torch.bfloat16).eval()
            logits, _ = run(twin)
            errors.append((logits.float() - exact)[keep].abs().max().item())
    return errors[0], errors[1]


@pytest.mark.parametrize("position_embedding_type, backend", backend_cases(FUSED_BACKENDS))
def test_decoder_backend_in_bf16_is_as_accurate_as_eager(position_embedding_type, backend):
    config = tiny_decoder_config(position_embedding_type=position_embedding_type, **CUDA_SHAPE)
    model = build_model(VaswaniForCausalLM, config, "eager")
    input_ids, mask = random_ids(3, LENGTH, CUDA_SHAPE["vocab_size"]).cuda(), mixed_padding_mask().cuda()

    def run(twin):
        return twin(input_ids, attention_mask=mask).logits.float(), mask

    eager_error, error = logits_errors(model, backend, run)
    assert error <= 2 * eager_error + 1e-2, (eager_error, error)


# flex compiles a kernel per position type: the encoder-decoder runs it on the two that add a bias to the scores.
SEQ2SEQ_CASES = [case for case in backend_cases(["sdpa", "flex_attention"]) if case[1] == "sdpa"] + [
    (kind, "flex_attention") for kind in POSITION_TYPES if kind not in BIAS_FREE_POSITION_TYPES
]


@pytest.mark.parametrize("position_embedding_type, backend", SEQ2SEQ_CASES)
def test_seq2seq_backend_in_bf16_is_as_accurate_as_eager(position_embedding_type, backend):
    config = tiny_seq2seq_config(position_embedding_type=position_embedding_type, **CUDA_SHAPE)
    model = build_model(VaswaniForConditionalGeneration, config, "eager")
    source, source_mask = random_ids(3, LENGTH, CUDA_SHAPE["vocab_size"]).cuda(), mixed_padding_mask().cuda()
    target = random_ids(3, 16, CUDA_SHAPE["vocab_size"], seed=1).cuda()

    def run(twin):
        logits = twin(input_ids=source, attention_mask=source_mask, decoder_input_ids=target).logits.float()
        return logits, torch.ones_like(target)

    eager_error, error = logits_errors(model, backend, run)
    assert error <= 2 * eager_error + 1e-2, (eager_error, error)


def test_a_bf16_trainer_run_on_the_gpu_lowers_the_loss(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build_model(VaswaniForCausalLM, tiny_decoder_config(**CUDA_SHAPE, initializer_range=0.02), "sdpa").train()
    sequences = random_ids(16, 32, CUDA_SHAPE["vocab_size"])  # 16 fixed sequences to learn by heart
    dataset = [{"input_ids": row, "labels": row} for row in sequences]
    computed_in = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: computed_in.append(out.dtype)
    )
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=True,
        max_steps=60,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        per_device_train_batch_size=8,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert next(model.parameters()).device.type == "cuda"
    assert computed_in and set(computed_in) == {torch.bfloat16}, set(computed_in)  # autocast ran the matmuls in bf16
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, losses


@pytest.mark.parametrize("position_embedding_type", ["rope", "alibi"])
def test_generate_with_a_compiled_static_cache_gives_the_dynamic_caches_tokens(position_embedding_type):
    from transformers import CompileConfig

    config = tiny_decoder_config(position_embedding_type=position_embedding_type, **CUDA_SHAPE)
    model = build_model(VaswaniForCausalLM, config, "sdpa").cuda()
    input_ids = random_ids(2, 12, CUDA_SHAPE["vocab_size"]).cuda()
    mask = padding_mask([12, 7], 12, "left").cuda()
    settings = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = model.generate(input_ids, **settings)  # dynamic cache, not compiled
    torch._dynamo.reset()
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # fullgraph: a graph break inside the model would raise instead of silently running eagerly.
    actual = model.generate(
        input_ids, cache_implementation="static", compile_config=CompileConfig(fullgraph=True), **settings
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames_before, "generate did not compile"
    assert torch.equal(actual, expected)


# ------------------------------------------------------------------------------ the commands on --device cuda


@pytest.fixture(scope="module")
def cuda_chat(tmp_path_factory):
    """(PyTorch chat folder, its fp16 export for CUDA, tokenizer), exported as the docs show."""
    onnxruntime = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs onnxruntime-gpu (CUDAExecutionProvider)")
    from vaswani.cli.main import main as vaswani_cli

    root = tmp_path_factory.mktemp("cuda_chat")
    tokenizer = tiny_chat_tokenizer()
    folder = tiny_gqa_chat_folder(root, tokenizer)
    export = root / "tiny-chat-fp16"
    arguments = ["export", "--model", str(folder), "--output", str(export), "--dtype", "fp16", "--device", "cuda"]
    assert vaswani_cli(arguments) == 0
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["validation"]["provider"] == "CUDAExecutionProvider" and manifest["validation"]["passed"]
    return folder, export, tokenizer


def offline_model(folder, backend: str):
    """The oracle's model, on the GPU: the export on ONNX Runtime's CUDA provider, or the PyTorch folder."""
    if backend == "onnx":
        from vaswani.runtime import OrtModelForCausalLM

        return OrtModelForCausalLM.from_pretrained(folder, provider="cuda")
    return VaswaniForCausalLM.from_pretrained(folder).cuda().eval()


def offline_chat_answer(model, tokenizer, question: str) -> str:
    """Greedy `generate` on one chat-templated question, alone, decoded as the server decodes."""
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = {name: tensor.cuda() for name, tensor in prompt.items()}
    with torch.inference_mode():
        tokens = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_vaswani_serve_on_cuda_answers_16_concurrent_chats_as_offline_generate(cuda_chat, backend):
    import httpx

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    torch_folder, export, tokenizer = cuda_chat
    folder = export if backend == "onnx" else torch_folder
    port = free_port()
    command = [sys.executable, "-m", "vaswani", "serve", str(folder), "--device", "cuda", "--port", str(port)]
    server = subprocess.Popen(
        command + ["--backend", backend], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def ask(question: str) -> str:
        body = {
            "model": folder.name,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": NEW_TOKENS,
        }
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]

    questions = (QUESTIONS * 2)[:16]
    try:
        assert wait_for(ready, timeout=180, interval=0.5), "the server did not start"
        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(ask, questions))
    finally:
        server.terminate()
        log = server.communicate(timeout=60)[0]
    model = offline_model(folder, backend)
    expected = [offline_chat_answer(model, tokenizer, question) for question in questions]
    assert answers == expected, log[-3000:]


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_chat_perplexity_and_bench_commands_run_on_cuda(cuda_chat, backend, tmp_path, capsys):
    from vaswani.cli.main import main as vaswani_cli
    from vaswani.data import corpus_stories
    from vaswani.evaluation.perplexity import folder_perplexity

    torch_folder, export, tokenizer = cuda_chat
    folder = export if backend == "onnx" else torch_folder
    arguments = ["chat", str(folder), "--prompt", "Hi", "--device", "cuda", "--max-new-tokens", str(NEW_TOKENS)]
    assert vaswani_cli(arguments) == 0
    assert capsys.readouterr().out == offline_chat_answer(offline_model(folder, backend), tokenizer, "Hi") + "\n"

    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(corpus_stories()[:20]))
    result = tmp_path / "perplexity.json"
    arguments = ["perplexity", str(folder), "--text", str(text), "--device", "cuda", "--json", str(result)]
    assert vaswani_cli(arguments + ["--context", "64", "--stride", "32"]) == 0
    on_cuda = json.loads(result.read_text())["perplexity"]
    on_cpu = folder_perplexity(torch_folder, text.read_text(), context=64, stride=32).perplexity  # float32 PyTorch
    tolerance = 1e-2 if backend == "onnx" else 1e-4  # fp16 export; float32 PyTorch on either device
    assert abs(on_cuda - on_cpu) <= tolerance * on_cpu, (on_cuda, on_cpu)

    bench = tmp_path / "bench.json"
    arguments = ["bench", str(folder), "--device", "cuda", "--batch-sizes", "1", "4", "--prompt-tokens", "16"]
    assert vaswani_cli(arguments + ["--new-tokens", "8", "--rounds", "1", "--json", str(bench)]) == 0
    rows = json.loads(bench.read_text())["rows"]
    assert [row["batch_size"] for row in rows] == [1, 4] and all(row["decode_tokens_per_s"] > 0 for row in rows)
