"""Hugging Face integration of `VaswaniForCausalLM`: saving, Auto classes, Hub custom code, push_to_hub,
gradient checkpointing, embedding resizing, tied weights, device maps, PEFT and pipelines.

Everything runs offline: models are a few tens of thousands of parameters, the tokenizer is trained here on
the packaged corpus, and `push_to_hub` talks to a fake Hub on 127.0.0.1.
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    pipeline,
)

import vaswani
from vaswani import (
    VaswaniDecoderConfig,
    VaswaniDecoderModel,
    VaswaniForCausalLM,
    VaswaniForSequenceClassification,
)
from vaswani.data.tokenization import corpus_tokenizer

VOCAB_SIZE = 300
CODE_FILES = ("configuration.py", "layers.py", "positions.py", "pretrained.py", "decoder.py")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def tiny_config(preset: str = "llama", **overrides) -> VaswaniDecoderConfig:
    """A tiny config of a preset: LLaMA-shaped (RoPE, RMSNorm, SwiGLU, GQA, untied) or GPT-2-shaped (tied)."""
    shape = {**TINY, "num_key_value_heads": 2} if preset == "llama" else {**TINY, "max_position_embeddings": 64}
    return VaswaniDecoderConfig.from_preset(preset, **{"vocab_size": VOCAB_SIZE, **shape, **overrides})


def tiny_model(preset: str = "llama", seed: int = 0, **overrides) -> VaswaniForCausalLM:
    torch.manual_seed(seed)
    return VaswaniForCausalLM(tiny_config(preset, **overrides)).eval()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> tuple[VaswaniForCausalLM, Path]:
    """A tiny LLaMA-shaped model and the folder it was saved to (read-only for the tests that share it)."""
    model = tiny_model("llama")
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return model, folder


@torch.no_grad()
def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model.eval()(input_ids).logits


# ------------------------------------------------------------------------------------------ save / Auto classes


@pytest.mark.parametrize("preset", ["llama", "gpt2"])
def test_save_pretrained_writes_safetensors_and_auto_class_reloads_bit_identical(preset, tmp_path, input_ids):
    model = tiny_model(preset)
    model.save_pretrained(tmp_path)

    files = sorted(path.name for path in tmp_path.iterdir())
    assert "model.safetensors" in files
    assert not [name for name in files if name.endswith((".bin", ".pt", ".pth", ".ckpt"))], files
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is VaswaniForCausalLM
    assert torch.equal(logits(reloaded, input_ids), logits(model, input_ids))


def test_auto_model_loads_the_base_model_of_a_causal_lm_checkpoint(saved_llama, input_ids):
    model, folder = saved_llama
    base = AutoModel.from_pretrained(folder)
    assert type(base) is VaswaniDecoderModel
    with torch.no_grad():
        assert torch.equal(base.eval()(input_ids).last_hidden_state, model.model(input_ids).last_hidden_state)


def test_auto_model_for_sequence_classification_round_trip(tmp_path, input_ids):
    torch.manual_seed(0)
    model = VaswaniForSequenceClassification(tiny_config("llama", num_labels=3, pad_token_id=1)).eval()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert isinstance(reloaded, VaswaniForSequenceClassification)
    assert torch.equal(logits(reloaded, input_ids), logits(model, input_ids))
    assert logits(model, input_ids).shape == (2, 3)


# --------------------------------------------------------------------------------------------- Hub custom code


def test_saved_folder_carries_its_code_and_an_auto_map(saved_llama):
    _, folder = saved_llama
    config = json.loads((folder / "config.json").read_text())
    # AutoModel too: engines that wrap the base model (vLLM's Transformers backend) build it from remote code.
    assert config["auto_map"] == {
        "AutoConfig": "configuration.VaswaniDecoderConfig",
        "AutoModel": "decoder.VaswaniDecoderModel",
        "AutoModelForCausalLM": "decoder.VaswaniForCausalLM",
    }
    source = Path(vaswani.__file__).parent / "modeling"
    saved_code = sorted(path.name for path in folder.glob("*.py"))
    assert set(CODE_FILES) <= set(saved_code), saved_code
    for name in saved_code:
        assert (folder / name).read_text() == (source / name).read_text(), f"{name} differs from the package's copy"


REMOTE_CODE_CHILD = """
import importlib.abc
import sys


class NoVaswani(importlib.abc.MetaPathFinder):
    # First on the meta path, ahead of the editable install's finder (or site-packages): vaswani is not installed.
    def find_spec(self, name, path=None, target=None):
        if name == "vaswani" or name.startswith("vaswani."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)


sys.meta_path.insert(0, NoVaswani())
try:
    import vaswani  # noqa: F401
except ImportError:
    pass
else:
    sys.exit("vaswani is importable in the child: the test would prove nothing")

import torch
from transformers import AutoModelForCausalLM

folder, expected = sys.argv[1], torch.load(sys.argv[2])
torch.set_num_threads(expected["num_threads"])  # bit-identical needs the parent's reduction order
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    got = model(expected["input_ids"]).logits
assert torch.equal(got, expected["logits"]), (got - expected["logits"]).abs().max()
assert not [name for name in sys.modules if name.split(".")[0] == "vaswani"]
print("remote code OK:", type(model).__module__)
"""


def test_trust_remote_code_loads_where_vaswani_is_not_installed(saved_llama, tmp_path, input_ids):
    model, folder = saved_llama
    expected = {"input_ids": input_ids, "logits": logits(model, input_ids), "num_threads": torch.get_num_threads()}
    torch.save(expected, tmp_path / "expected.pt")
    (tmp_path / "child.py").write_text(REMOTE_CODE_CHILD)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),  # where transformers copies the folder's code to import it
    }
    # -I: no cwd or PYTHON* variables on the path; the cwd is outside the repository anyway.
    command = [sys.executable, "-I", str(tmp_path / "child.py"), str(folder), str(tmp_path / "expected.pt")]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "remote code OK: transformers_modules." in result.stdout


# ------------------------------------------------------------------------------------------------- push_to_hub


class FakeHub(ThreadingHTTPServer):
    """A loopback stand-in for the few Hub API routes `push_to_hub` calls; records every request.

    It answers `preupload` with `uploadMode: regular` for every file, so contents arrive base64-encoded in the
    commit's NDJSON body and no LFS or Xet upload is attempted.
    """

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _FakeHubHandler)
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.authorization: dict[tuple[str, str], str | None] = {}
        self.commits: list[dict] = []  # {"header": {...}, "files": {path: bytes}, "other": [non-inline NDJSON lines]}

    @property
    def endpoint(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _FakeHubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _reply(self, status: int, body: dict | None = None, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _route(self) -> None:
        hub, path = self.server, self.path.split("?")[0]
        hub.requests.append((self.command, path))
        hub.authorization[self.command, path] = self.headers.get("Authorization")
        body = self._body() if self.command == "POST" else b""
        if self.command == "POST" and path == "/api/repos/create":
            payload = json.loads(body)
            return self._reply(200, {"url": f"{hub.endpoint}/{payload['organization']}/{payload['name']}"})
        if self.command == "POST" and path == "/api/validate-yaml":
            return self._reply(200, {"errors": [], "warnings": []})
        if self.command == "POST" and path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(body)["files"]
            return self._reply(
                200,
                {
                    "files": [
                        {"path": file["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                        for file in files
                    ]
                },
            )
        if self.command == "POST" and path.startswith("/api/models/") and "/commit/" in path:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            commit = {"header": None, "files": {}, "other": []}
            for line in lines:
                if line["key"] == "header":
                    commit["header"] = line["value"]
                elif line["key"] == "file" and line["value"]["encoding"] == "base64":
                    commit["files"][line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                else:
                    commit["other"].append(line)
            hub.commits.append(commit)
            repo_id = path.removeprefix("/api/models/").split("/commit/")[0]
            oid = f"{len(hub.commits):040x}"
            return self._reply(
                200, {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
            )
        if self.command in ("GET", "HEAD") and "/resolve/" in path:  # no README.md yet: a fresh repo
            return self._reply(
                404,
                {"error": "Entry not found"},
                {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"},
            )
        return self._reply(404, {"error": f"the fake Hub does not serve {self.command} {path}"})

    do_GET = do_HEAD = do_POST = do_PUT = _route


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Point huggingface_hub (and transformers' shared `HfApi`) at a `FakeHub` on 127.0.0.1 for one test."""
    import huggingface_hub.constants as hub_constants
    import transformers.utils.hub as transformers_hub

    hub = FakeHub()
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()
    # huggingface_hub reads HF_ENDPOINT once, at import, into these two constants; `HfApi()` copies ENDPOINT
    # when built, so transformers' cached instance is dropped and rebuilt against the fake endpoint.
    monkeypatch.setattr(hub_constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(
        hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(transformers_hub, "_hf_api", None)
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    yield hub
    hub.shutdown()
    hub.server_close()


def test_push_to_hub_uploads_weights_config_code_and_generation_config(fake_hub):
    model = tiny_model("llama")
    model.push_to_hub("vaswani-tests/tiny-llama", token="hf_fake_token_for_loopback")

    assert [request for request in fake_hub.requests if request[1] != "/api/agent-harnesses"] == [
        ("POST", "/api/repos/create"),
        ("HEAD", "/vaswani-tests/tiny-llama/resolve/main/README.md"),  # an existing model card would be updated
        ("POST", "/api/validate-yaml"),  # the generated model card's metadata
        ("POST", "/api/models/vaswani-tests/tiny-llama/preupload/main"),
        ("POST", "/api/models/vaswani-tests/tiny-llama/commit/main"),
    ], "push_to_hub made unexpected Hub calls (no LFS or Xet upload should happen)"
    # huggingface_hub fetches its public list of coding agents (for the user agent) without a token.
    authorized = {route: auth for route, auth in fake_hub.authorization.items() if route[1] != "/api/agent-harnesses"}
    assert set(authorized.values()) == {"Bearer hf_fake_token_for_loopback"}, authorized
    assert len(fake_hub.commits) == 1
    commit = fake_hub.commits[0]
    assert commit["other"] == [], "every file should be committed inline (regular upload mode)"
    uploaded = commit["files"]
    assert {"model.safetensors", "config.json", "generation_config.json", "README.md", *CODE_FILES} <= set(uploaded)
    assert not [name for name in uploaded if name.endswith(".bin")]
    tensors = load_safetensors(uploaded["model.safetensors"])
    state = model.state_dict()
    assert set(tensors) == set(state)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[name]), name
    config = json.loads(uploaded["config.json"])
    assert config["model_type"] == "vaswani_decoder"
    assert config["auto_map"]["AutoModelForCausalLM"] == "decoder.VaswaniForCausalLM"
    source = Path(vaswani.__file__).parent / "modeling"
    for name in [name for name in uploaded if name.endswith(".py")]:
        assert uploaded[name] == (source / name).read_bytes(), f"{name} differs from the package's copy"
    assert "transformers_version" in json.loads(uploaded["generation_config.json"])


# --------------------------------------------------------------------------------------- training integrations


@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(enable, input_ids):
    if not hasattr(VaswaniForCausalLM, enable):
        pytest.skip(f"this transformers has no {enable}")
    model = tiny_model("llama").train()
    mlp_calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))

    plain = model(input_ids, labels=input_ids).loss
    plain.backward()
    plain_grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    assert len(mlp_calls) == 1

    getattr(model, enable)()
    checkpointed = model(input_ids, labels=input_ids).loss
    checkpointed.backward()
    assert len(mlp_calls) == 3, "with checkpointing, the block's forward runs again during backward"
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_resize_token_embeddings_grows_vocab_and_lm_head(preset):
    model = tiny_model(preset)
    old_embeddings = model.get_input_embeddings().weight.detach().clone()
    old_head = model.lm_head.weight.detach().clone()

    model.resize_token_embeddings(VOCAB_SIZE + 20, mean_resizing=False)

    assert model.config.vocab_size == VOCAB_SIZE + 20
    assert model.get_input_embeddings().weight.shape == (VOCAB_SIZE + 20, 32)
    assert model.lm_head.weight.shape == (VOCAB_SIZE + 20, 32)
    assert torch.equal(model.get_input_embeddings().weight[:VOCAB_SIZE], old_embeddings)
    assert torch.equal(model.lm_head.weight[:VOCAB_SIZE], old_head)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    else:
        assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    new_ids = torch.tensor([[VOCAB_SIZE + 19, 5, VOCAB_SIZE]])
    assert logits(model, new_ids).shape == (1, 3, VOCAB_SIZE + 20)
    loss = model.train()(new_ids, labels=new_ids).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("preset", ["gpt2", "llama"])
def test_tied_weights_survive_save_and_load(preset, tmp_path, input_ids):
    model = tiny_model(preset)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    embeddings, head = reloaded.model.embed_tokens.weight, reloaded.lm_head.weight
    if preset == "gpt2":
        assert reloaded.config.tie_word_embeddings
        assert head is embeddings
        assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors"), "a tied head is stored once"
    else:
        assert not reloaded.config.tie_word_embeddings
        assert head.data_ptr() != embeddings.data_ptr()
        assert not torch.equal(head, embeddings)
        assert torch.equal(head, model.lm_head.weight)
    assert torch.equal(logits(reloaded, input_ids), logits(model, input_ids))


def test_device_map_auto_loads_on_cpu(saved_llama, input_ids):
    model, folder = saved_llama
    reloaded = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    assert {param.device.type for param in reloaded.parameters()} == {"cpu"}
    assert torch.equal(logits(reloaded, input_ids), logits(model, input_ids))


def test_device_map_auto_offloads_whole_blocks_when_memory_is_short(tmp_path, input_ids):
    """With too little memory, accelerate puts some blocks on disk; `_no_split_modules` keeps each block whole."""
    model = tiny_model("llama", num_hidden_layers=4)
    model.save_pretrained(tmp_path / "model")
    size = sum(param.numel() * param.element_size() for param in model.parameters())

    reloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": int(0.7 * size)}, offload_folder=tmp_path / "offload"
    )

    device_map = reloaded.hf_device_map
    assert set(device_map.values()) == {"cpu", "disk"}, device_map
    split_blocks = [name for name in device_map if name.startswith("model.layers.") and name.count(".") > 2]
    assert not split_blocks, f"VaswaniBlock was split across devices: {device_map}"
    assert torch.equal(logits(reloaded, input_ids), logits(model, input_ids))


def test_lora_trains_only_adapters_and_merges_to_the_same_model(input_ids):
    peft = pytest.importorskip("peft")
    model = tiny_model("llama")
    frozen = {name: param.detach().clone() for name, param in model.named_parameters()}
    base = logits(model, input_ids)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )

    trainable = [name for name, param in lora.named_parameters() if param.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable}
    assert adapted == set(LORA_TARGETS)
    before = logits(lora, input_ids)
    assert torch.equal(before, base), "LoRA's B matrices start at zero, so the wrapped model is unchanged"

    optimizer = torch.optim.AdamW([param for param in lora.parameters() if param.requires_grad], lr=1e-2)
    lora.train()
    for _ in range(3):
        lora(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = logits(lora, input_ids)
    assert not torch.allclose(after, before, atol=1e-4)
    for name, param in lora.base_model.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, frozen[name.replace(".base_layer", "")]), f"{name} should stay frozen"

    merged = lora.merge_and_unload()
    assert type(merged) is VaswaniForCausalLM
    torch.testing.assert_close(logits(merged, input_ids), after, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------- pipelines


def test_text_generation_pipeline_uses_the_tokenizer_saved_beside_the_model(tmp_path):
    tokenizer = corpus_tokenizer(vocab_size=VOCAB_SIZE, kilobytes=50)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    model = VaswaniForCausalLM(tiny_config("llama", vocab_size=len(tokenizer), **ids)).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    generator = pipeline("text-generation", model=str(tmp_path))
    prompt = "Once upon a time, there was"
    text = generator(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]

    assert isinstance(generator.model, VaswaniForCausalLM)
    assert text.startswith(prompt) and len(text) > len(prompt)
    expected = model.generate(tokenizer(prompt, return_tensors="pt").input_ids, max_new_tokens=8, do_sample=False)
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------- broken folders


def test_missing_weights_file_error_names_it(saved_llama, tmp_path):
    _, folder = saved_llama
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights_file_fails_to_load(damage, saved_llama, tmp_path):
    _, folder = saved_llama
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"this is not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises((SafetensorError, OSError)):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_corrupt_weights_file_error_names_it(saved_llama, tmp_path):
    _, folder = saved_llama
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").write_bytes(b"this is not a safetensors file")
    # transformers lets safetensors' bare "Error while deserializing header" escape; vaswani names the file.
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
