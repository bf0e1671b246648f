"""`vaswani serve --ray`: two replicas of the app on a local Ray cluster (loopback, 1 CPU each) answer the same routes
as the single-process server, with the same greedy answers as offline `generate`, and the router uses both."""

import os
import socket

import httpx
import pytest
from serving_cases import offline_answer, tiny_chat_folders, tiny_chat_tokenizer

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from vaswani.conversion.onnx import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.serving.ray_app import build_ray_app  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    tokenizer = tiny_chat_tokenizer()
    _, folder = tiny_chat_folders(tmp_path_factory.mktemp("ray"), tokenizer)
    # The replicas import vaswani from where this test does (a worktree on PYTHONPATH, or the installed package).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            build_ray_app(str(folder), replicas=2, cpus_per_replica=1, max_batch=4), name="tiny", route_prefix="/"
        )
        yield f"http://127.0.0.1:{port}", folder, tokenizer
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_ray_replicas_answer_the_openai_routes_like_one_server(ray_server):
    url, folder, tokenizer = ray_server
    offline = OrtModelForCausalLM.from_pretrained(folder, session_options=default_session_options(1))
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    expected, _ = offline_answer(offline, tokenizer, prompt, 16)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [model.id for model in client.models.list()] == [folder.name]
    for _ in range(4):  # answered by either replica: always generate's answer
        reply = client.chat.completions.create(model=folder.name, messages=messages, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=folder.name, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == expected

    bad = httpx.post(url + "/v1/chat/completions", json={"model": folder.name, "messages": messages, "max_tokens": 0})
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]

    status = serve.status().applications["tiny"].deployments["vaswani"]
    assert status.replica_states.get("RUNNING") == 2
    replicas = {httpx.get(url + "/health").json()["pid"] for _ in range(40)}
    assert len(replicas) == 2  # the router sends requests to both
