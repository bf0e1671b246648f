"""The package as a user gets it: a wheel built from this tree, installed into a fresh venv, and every `vaswani`
command run from a folder outside the repository on a tiny chat model built here. This is what catches a module or
data file the wheel leaves out, a command that imports from `scripts/` or `tests/`, or a console script that is not
declared.

The fresh venv sees the test environment's dependencies (torch, transformers, onnxruntime, ...) through a .pth line,
but not its editable vaswani: `vaswani` must come from the wheel. Oracles: the answer `vaswani chat` prints equals
offline greedy `generate` on the same folder in this process, and the served answer equals it too; the perplexity it
prints equals `vaswani.evaluation.perplexity` here.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from serving_cases import free_port, wait_for

pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")
pytest.importorskip("peft")

import torch  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from vaswani.data import corpus_stories  # noqa: E402
from vaswani.data.chat import chat_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("convert", "export", "finetune", "chat", "perplexity", "bench", "serve")
QUESTION = "Tell me a story."
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel of this tree installed (no dependencies: those come from the test environment)."""
    build = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", build / "dist", ROOT],
        check=True,
        cwd=build,
    )
    (wheel,) = (build / "dist").glob("vaswani-*.whl")
    venv = build / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    site_packages = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # --force-reinstall: pip finds the test environment's editable vaswani (it never touches a distribution outside
    # the target environment) and would otherwise call the wheel installed already.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--force-reinstall", "-q", wheel],
        check=True,
        cwd=build,
        env=without_pythonpath(),
    )
    # Then the test environment's packages, appended after the venv's own. A plain path line runs none of that
    # environment's .pth files, so its editable vaswani stays off the path.
    (site_packages / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Outside the repository: a transformers LLaMA chat checkpoint, conversations and a text file."""
    folder = tmp_path_factory.mktemp("user")
    stories = corpus_stories()
    tokenizer = chat_tokenizer(stories, vocab_size=400, model_max_length=256)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "llama")
    tokenizer.save_pretrained(folder / "llama")
    with open(folder / "chats.jsonl", "w") as file:
        for story in stories[:8]:
            messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": story[:200]}]
            file.write(json.dumps({"messages": messages}) + "\n")
    (folder / "story.txt").write_text("\n\n".join(stories[8:12]))
    return folder


def without_pythonpath() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def vaswani(venv: Path, cwd: Path, *arguments: str, **options) -> subprocess.CompletedProcess:
    """Run the installed `vaswani` console script in `cwd`, with nothing of this repository on the path."""
    return subprocess.run(
        [venv / "bin" / "vaswani", *arguments],
        cwd=cwd,
        env=without_pythonpath(),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        **options,
    )


def test_vaswani_comes_from_the_wheel(installed, workspace) -> None:
    location = subprocess.run(
        [installed / "bin" / "python", "-c", "import vaswani; print(vaswani.__file__)"],
        cwd=workspace,
        env=without_pythonpath(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(location).is_relative_to(installed), location
    usage = vaswani(installed, workspace, "--help").stdout
    assert all(command in usage for command in COMMANDS), usage


def test_every_command_runs_from_the_installed_package(installed, workspace) -> None:
    from vaswani.evaluation.perplexity import folder_perplexity
    from vaswani.runtime import OrtModelForCausalLM

    run = lambda *arguments: vaswani(installed, workspace, *arguments)  # noqa: E731
    run("convert", "--from", "llama", "--to", "chat-model")
    run(
        "finetune", "--model", "chat-model", "--train_file", "chats.jsonl", "--output_dir", "tuned",
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--report_to", "none", "--save_strategy", "no",
    )  # fmt: skip
    run("export", "--model", "tuned/model", "--output", "chat-onnx")

    answer = run("chat", "chat-onnx", "--prompt", QUESTION, "--max-new-tokens", "8").stdout.strip()
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat-onnx")
    model = OrtModelForCausalLM.from_pretrained(workspace / "chat-onnx")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    tokens = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(tokens[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert answer == expected

    run("perplexity", "chat-onnx", "--text", "story.txt", "--json", "perplexity.json")
    measured = json.loads((workspace / "perplexity.json").read_text())
    assert measured["perplexity"] == pytest.approx(
        folder_perplexity(workspace / "chat-onnx", (workspace / "story.txt").read_text()).perplexity, rel=1e-6
    )

    run("bench", "chat-onnx", "--batch-sizes", "1", "--prompt-tokens", "8", "--new-tokens", "4", "--rounds", "1",
        "--json", "bench.json")  # fmt: skip
    assert json.loads((workspace / "bench.json").read_text())

    port = free_port()
    server = subprocess.Popen(
        [installed / "bin" / "vaswani", "serve", "chat-onnx", "--port", str(port)],
        cwd=workspace,
        env=without_pythonpath(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import httpx

        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(ready, timeout=120), "the installed server did not start"
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "chat-onnx",
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip() == expected
    finally:
        server.terminate()
        server.wait(timeout=60)
