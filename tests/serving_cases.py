"""Shared pieces of the server tests: tiny chat models exported with a ChatML tokenizer, and a uvicorn server running
an app on a free loopback port in a thread."""

import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from conftest import build_model, tiny_decoder_config

from vaswani import VaswaniForCausalLM
from vaswani.data import corpus_stories
from vaswani.data.chat import chat_tokenizer
from vaswani.export import export_onnx

# Rope, grouped-query attention: the shape of the real chat models. A long context, so that a stream can be cut in
# the middle (a tiny model decodes a token in about a millisecond).
CONTEXT = 2048


# Chat questions of different lengths, whose greedy answers differ (a swapped row would show).
QUESTIONS = [
    "Hi",
    "Tell me a story about a cat.",
    "Once upon a time there was a little girl who lived in a village near the forest. What happened next?",
    "Why is the sky blue?",
    "a b c",
    "What did the dog say to the bird when they met in the garden and the sun was shining on them both?",
    "Hello!",
    "Count to ten.",
]


def tiny_chat_tokenizer():
    return chat_tokenizer(corpus_stories()[:150], vocab_size=300)


def saved_tiny_chat_llama(folder: Path):
    """transformers' LlamaForCausalLM (tiny, seeded, grouped-query, head_dim 16), saved to `folder` with the tiny
    chat tokenizer (the commands load one); returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = tiny_chat_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def tiny_chat_folders(root: Path, tokenizer) -> tuple[Path, Path]:
    """(PyTorch folder, ONNX export) of a tiny chat model; its end-of-sequence is the tokenizer's `<|im_end|>`."""
    config = tiny_decoder_config(
        vocab_size=len(tokenizer),
        max_position_embeddings=CONTEXT,
        position_embedding_type="rope",
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    torch_folder, onnx_folder = root / "tiny-chat-pt", root / "tiny-chat"
    model.save_pretrained(torch_folder)
    tokenizer.save_pretrained(torch_folder)
    export_onnx(torch_folder, onnx_folder, task="text-generation", validate=False)
    return torch_folder, onnx_folder


def tiny_gqa_chat_folder(root: Path, tokenizer) -> Path:
    """A PyTorch folder of a tiny chat model that the GroupQueryAttention form fits (head_dim 16: ONNX Runtime's
    kernel takes multiples of 16), for exports of every form."""
    config = tiny_decoder_config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        position_embedding_type="rope",
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    folder = root / "tiny-gqa-chat-pt"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread; `url` is its base address."""

    def __init__(self, app, timeout: float = 30.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serving(app):
    server = ServerThread(app)
    try:
        yield server
    finally:
        server.close()


def offline_answer(model, tokenizer, prompt: list[int], max_new_tokens: int) -> tuple[str, list[int]]:
    """The oracle: `generate`'s greedy answer to `prompt`, as (text, tokens)."""
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    tokens = output[0, len(prompt) :].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition, timeout: float = 20.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return False


def server_answers(http, process: subprocess.Popen):
    """For `wait_for`: whether a `vaswani serve` process answers /health on `http` (an httpx client), or has exited
    (then waiting is over; the caller asserts it still runs)."""
    import httpx

    def answers() -> bool:
        try:
            return http.get("/health").status_code == 200
        except httpx.TransportError:
            return process.poll() is not None

    return answers


def self_signed_certificate(folder: Path) -> tuple[Path, Path] | None:
    """(key, certificate) for 127.0.0.1, made with the openssl command, or None without it."""
    if shutil.which("openssl") is None:
        return None
    key, certificate = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(certificate)],
        check=True,
        capture_output=True,
    )
    return key, certificate


def scheduled_results(scheduler, requests: list, timeout: float = 60) -> list[tuple[list[int], str, str | None]]:
    """Each request's (tokens, finish reason, error) from `scheduler` (`requests`: (prompt ids, SamplingParams)
    pairs), every request submitted before it starts, so the first ones are prefilled as one group; the scheduler is
    stopped after."""
    results = [([], None, None) for _ in requests]
    finished = threading.Semaphore(0)

    def emitter(index):
        def emit(event):
            tokens, _, _ = results[index]
            if event.token is not None:
                tokens.append(event.token)
            if event.finish_reason is not None:
                results[index] = (tokens, event.finish_reason, event.error)
                finished.release()

        return emit

    for index, (prompt, params) in enumerate(requests):
        scheduler.submit(prompt, params, emitter(index))
    scheduler.start()
    try:
        for _ in requests:
            assert finished.acquire(timeout=timeout), "the scheduler did not finish every request"
    finally:
        scheduler.stop()
    return results


def scheduled_tokens(scheduler, requests: list, timeout: float = 60) -> list[list[int]]:
    """Each request's tokens from `scheduler` (`scheduled_results`)."""
    return [tokens for tokens, _, _ in scheduled_results(scheduler, requests, timeout)]


def scrape(http) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a server's /metrics (`http`: an httpx client on its base address),
    through prometheus' own parser."""
    from prometheus_client import parser

    text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in parser.text_string_to_metric_families(text)
        for sample in family.samples
    }
