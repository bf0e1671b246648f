"""The README's serve section, command by command, on a small chat model built here (nothing downloads): each
`vaswani` command of its bash blocks runs as written, with the README's folder names and ports swapped for temporary
ones (the export validates against PyTorch, as the README's does), the openai-client example runs against the served
folder, and so does the curl command.

Oracles: the exporter's validation; offline greedy `generate` of the same folder (the served greedy answer); the
README's own example code (it must run and print an answer). Servers bind 127.0.0.1 on free ports.
"""

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving_cases import (
    free_port,
    offline_answer,
    self_signed_certificate,
    server_answers,
    tiny_chat_tokenizer,
    tiny_gqa_chat_folder,
    wait_for,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("fastapi")
pytest.importorskip("openai")
import vaswani  # noqa: E402, F401  (registers the vaswani classes with the Auto classes)
from vaswani.cli.main import main as vaswani_cli  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM  # noqa: E402
from vaswani.runtime.contract import FORM_GQA  # noqa: E402

README = Path(__file__).resolve().parents[1] / "docs" / "serving.md"  # the serve section moved here


def serve_section() -> str:
    text = README.read_text()
    return text[: text.index("\n## Serving at scale with vLLM")]


def code_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def vaswani_commands(section: str) -> list[list[str]]:
    """Every `vaswani ...` command of the section's bash blocks (continued lines joined), split as a shell would,
    comments dropped."""
    commands = []
    for block in code_blocks(section, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith("vaswani "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def swap(arguments: list[str], names: dict[str, str]) -> list[str]:
    return [names.get(argument, argument) for argument in arguments]


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    """The README's folders: `./smol-vaswani` (a PyTorch chat model) and what its export commands write."""
    root = tmp_path_factory.mktemp("serve_journey")
    torch_folder = tiny_gqa_chat_folder(root, tiny_chat_tokenizer())  # head_dim 16: int8 takes the GQA form
    return root, {"./smol-vaswani": str(torch_folder)}


def test_the_readme_serve_commands_export_serve_and_answer(journey):
    root, names = journey
    commands = vaswani_commands(serve_section())
    exports = [command for command in commands if command[0] == "export"]
    serves = [command for command in commands if command[0] == "serve" and "--ray" not in command]
    assert exports and serves, "the README's serve section lost its commands"
    for command in exports:
        output = command[command.index("--output") + 1]
        names[output] = str(root / Path(output).name)  # the served model keeps the README's name (smol-int8)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            assert vaswani_cli(swap(command, names)) == 0, stderr.getvalue()
        if "--quantize" in command:  # what SmolLM2's quantized export is: the form the server failed on (500)
            manifest = json.loads((Path(names[output]) / "manifest.json").read_text())
            assert manifest["attention_form"] == FORM_GQA, manifest.get("attention_form_note")
    example = code_blocks(serve_section(), "python")[0]
    curl = next(block for block in code_blocks(serve_section(), "bash") if block.startswith("curl"))
    certificate = self_signed_certificate(root)
    for command in serves:
        port = free_port()
        # Tests bind loopback only; the README's key and certificate files are made here.
        local = {"8000": str(port), "8443": str(port), "0.0.0.0": "127.0.0.1"}
        if certificate is not None:
            local |= {"key.pem": str(certificate[0]), "cert.pem": str(certificate[1])}
        elif "--ssl-keyfile" in command:
            continue  # no openssl to make a certificate with
        arguments = swap(command, {**names, **local})
        served = Path(arguments[1]).name
        tls = "--ssl-certfile" in arguments
        api_key = "journey-key" if tls else None  # the README's TLS command runs with VASWANI_API_KEY exported
        with serve_process(arguments, port, tls, api_key) as (url, http):
            check_greedy_answer(http, served, arguments[1])
            if api_key is not None:
                assert http.post("/v1/chat/completions", headers={"Authorization": "Bearer wrong"}).status_code == 401
                continue
            if served == "smol-int8":  # the README's client example and curl name this folder
                code = example.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(code, "README.md (serve example)", "exec"), {})
                assert printed.getvalue().strip()
                reply = subprocess.run(
                    shlex.split(curl.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace("\\\n", " ")),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert reply.returncode == 0 and "data: [DONE]" in reply.stdout, reply.stdout + reply.stderr


@contextlib.contextmanager
def serve_process(arguments: list[str], port: int, tls: bool, api_key: str | None):
    """`vaswani serve ARGUMENTS` as a process of its own (with `VASWANI_API_KEY` set when `api_key` is given);
    yields its base URL and an HTTP client for it (sending the key) once /health answers."""
    environment = os.environ.copy()
    if api_key is not None:
        environment["VASWANI_API_KEY"] = api_key
    process = subprocess.Popen(
        [sys.executable, "-m", "vaswani.cli.main", *arguments, "--threads", "1", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=environment,
    )
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    certificate = arguments[arguments.index("--ssl-certfile") + 1] if tls else True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.Client(base_url=url, verify=certificate, headers=headers, timeout=120)

    try:
        assert wait_for(server_answers(http, process), timeout=120) and process.poll() is None, (
            process.stdout.read().decode()
        )
        yield url, http
    finally:
        http.close()
        process.terminate()
        process.wait(timeout=60)


def check_greedy_answer(http: httpx.Client, model: str, folder: str) -> None:
    """A greedy chat answer of the served folder equals offline `generate`'s on the same prompt (ONNX Runtime's for
    an export, PyTorch's for a PyTorch folder)."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    tokenizer = AutoTokenizer.from_pretrained(folder)
    exported = (Path(folder) / "manifest.json").is_file()
    offline = OrtModelForCausalLM.from_pretrained(folder) if exported else AutoModelForCausalLM.from_pretrained(folder)
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    text, _ = offline_answer(offline, tokenizer, prompt, 12)
    assert response.json()["choices"][0]["message"]["content"] == text
