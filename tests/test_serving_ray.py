"""`vaswani serve --ray` on one local Ray cluster (loopback, logical CPUs) shared by every test here: two replicas of the
app answer the same routes as the single-process server, with the same greedy answers as offline `generate`, and the
router uses both; a second model runs beside the first under its own application and route, and stopping it leaves
the first up; the replica's queue limit (429) is reached through Ray's router; `--device cuda` reserves a GPU."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import httpx
import pytest
from serving_cases import offline_answer, tiny_chat_tokenizer

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.serving.ray_app import build_ray_app  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worktree_env() -> dict[str, str]:
    """The replicas (and the CLI's process) import vaswani from where this test does (a worktree on PYTHONPATH, or
    the installed package)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


# The tests that start a Ray cluster (about 45 s together on 2 cores): `make test-slow`, which CI runs.
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tiny_chat_pair):
    tokenizer, folder = tiny_chat_tokenizer(), tiny_chat_pair["onnx"]
    offline = OrtModelForCausalLM.from_pretrained(folder, session_options=default_session_options(1))
    prompt = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"])
    expected, _ = offline_answer(offline, tokenizer, prompt, 16)
    return folder, tokenizer, expected


@pytest.fixture(scope="module")
def cluster():
    """One Ray cluster and Serve instance for every test here (starting them costs seconds). Logical CPUs: Ray only
    counts them, and the replicas of the tiny model share the machine's cores."""
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": worktree_env()}, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}", port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(cluster, tiny):
    url, _ = cluster
    folder, tokenizer, expected = tiny
    serve.run(build_ray_app(str(folder), replicas=2, cpus_per_replica=1, max_batch=4), name="tiny", route_prefix="/")
    return url, folder, expected


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def chat(url: str, model: str, api_key: str = "unused") -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    return reply.choices[0].message.content


@SLOW
def test_two_ray_replicas_answer_the_openai_routes_like_one_server(ray_server):
    url, folder, expected = ray_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [model.id for model in client.models.list()] == [folder.name]
    for _ in range(4):  # answered by either replica: always generate's answer
        assert chat(url, folder.name) == expected
    stream = client.chat.completions.create(
        model=folder.name, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected

    bad = httpx.post(url + "/v1/chat/completions", json={"model": folder.name, "messages": MESSAGES, "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]

    status = serve.status().applications["tiny"].deployments["vaswani"]
    assert status.replica_states.get("RUNNING") == 2
    replicas = {httpx.get(url + "/health").json()["pid"] for _ in range(40)}
    assert len(replicas) == 2  # the router sends requests to both


@SLOW
def test_a_second_model_runs_beside_the_first_and_stopping_it_deletes_only_its_own_application(ray_server, cluster):
    """`vaswani serve --ray` joined to a cluster that already serves a model: its model gets an application and a
    route of its own (it used to take the fixed name "vaswani"), and SIGTERM deletes that application only (it used
    to call serve.shutdown(), which deletes every application on the cluster)."""
    url, folder, expected = ray_server
    _, port = cluster
    command = [sys.executable, "-m", "vaswani.cli.main", "serve", str(folder), "--ray", "--port", str(port)]
    command += ["--ray-address", ray.get_runtime_context().gcs_address, "--model-name", "second"]
    command += ["--route-prefix", "/second", "--cpus-per-replica", "0.5", "--max-batch", "2"]
    command += ["--runtime-env", json.dumps({"env_vars": worktree_env()}), "--api-key", "second-key"]
    process = subprocess.Popen(
        command, env={**os.environ, **worktree_env()}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        while not answers(url + "/second/health"):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the second model did not come up in 180 s"
            time.sleep(0.5)
        assert set(serve.status().applications) >= {"tiny", "second"}
        assert chat(url + "/second", "second", api_key="second-key") == expected  # the replicas check the key
        refused = httpx.post(url + "/second/v1/chat/completions", json={"model": "second", "messages": MESSAGES})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert chat(url, folder.name) == expected  # the first model, untouched
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "second" not in serve.status().applications
    assert "tiny" in serve.status().applications
    assert chat(url, folder.name) == expected  # still serving


@SLOW
def test_the_replica_queue_limit_answers_429_through_ray(cluster, tiny):
    """Ray's router holds at most max_ongoing_requests per replica and queues the rest itself, where nobody answers
    429; it used to be max(16, max_batch + max_waiting), exactly the engine's capacity, so the 429 never came (the
    request waited in Ray's queue instead). Here the engine holds 1 running + 15 waiting sequences: with 16 long
    streams open (one running, 15 waiting behind it), one more request is refused at once with OpenAI's 429 body."""
    url, _ = cluster
    folder, _, _ = tiny
    app = build_ray_app(str(folder), replicas=1, cpus_per_replica=0.5, max_batch=1, max_waiting=15, name="queue")
    serve.run(app, name="queue", route_prefix="/queue")
    try:
        long_body = {"model": "queue", "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        short_body = {"model": "queue", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
        with httpx.Client(base_url=url + "/queue", timeout=60) as http, ExitStack() as streams:
            for _ in range(16):  # each returns once the replica accepted it (a 200 and its headers)
                stream = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=long_body))
                assert stream.status_code == 200
            refused = http.post("/v1/chat/completions", json=short_body)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "rate_limit_error" and "Retry-After" in refused.headers
    finally:
        serve.delete("queue")


def test_the_deployment_reserves_gpus_with_cuda_and_carries_the_runtime_env(tiny):
    """What Ray is asked for, read from the built deployment (no GPU here): `--device cuda` reserves one GPU per
    replica by default (it reserved none), `--gpus-per-replica` sets it, the CPU default reserves none, the runtime
    env reaches the replicas' actor options, and the router may send more than the engine holds."""
    from vaswani.serving.ray_app import replica_max_ongoing_requests

    folder = str(tiny[0])

    def deployment(**options):
        return build_ray_app(folder, **options)._bound_deployment  # Ray's Application keeps its deployment here

    assert deployment(provider="cuda").ray_actor_options["num_gpus"] == 1
    assert deployment(provider="cuda", gpus_per_replica=0.5).ray_actor_options["num_gpus"] == 0.5
    assert deployment(provider="cpu").ray_actor_options.get("num_gpus", 0) == 0
    with pytest.raises(ValueError, match="gpus-per-replica"):
        build_ray_app(folder, provider="cuda", gpus_per_replica=0)
    runtime_env = {"env_vars": {"OMP_NUM_THREADS": "1"}, "pip": ["numpy"]}
    assert deployment(runtime_env=runtime_env).ray_actor_options["runtime_env"] == runtime_env
    limit = deployment(max_batch=3, max_waiting=5).max_ongoing_requests
    assert limit == replica_max_ongoing_requests(3, 5) > 3 + 5
    assert deployment(max_ongoing_requests=7).max_ongoing_requests == 7


def test_runtime_env_option_reads_json_text_and_json_or_yaml_files(tmp_path):
    from vaswani.serving.ray_app import load_runtime_env

    runtime_env = {"env_vars": {"A": "1"}, "working_dir": "/shared/code"}
    assert load_runtime_env(json.dumps(runtime_env)) == runtime_env
    (tmp_path / "env.json").write_text(json.dumps(runtime_env))
    assert load_runtime_env(str(tmp_path / "env.json")) == runtime_env
    (tmp_path / "env.yaml").write_text("env_vars:\n  A: '1'\nworking_dir: /shared/code\n")
    assert load_runtime_env(str(tmp_path / "env.yaml")) == runtime_env
    assert load_runtime_env(None) is None
    for bad in ("not json", "[1, 2]"):
        with pytest.raises(ValueError, match="runtime-env"):
            load_runtime_env(bad)
