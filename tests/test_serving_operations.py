"""`vaswani serve` in operation: shutdown and disconnects, the engine watchdog, the event loop kept free (body limit,
incremental detokenization), the request timeout, and what operators need (API key, CORS, TLS, /metrics, request
ids, access log).

Oracles: the process' own exit (SIGTERM), `tokenizer.decode` of the whole answer (the streamed text), prometheus'
own text parser (/metrics), the official `openai` client (the API key), offline greedy `generate` (answers served
beside cancelled ones). Servers bind 127.0.0.1 on a free port.
"""

import copy
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving_cases import (
    CONTEXT,
    free_port,
    offline_answer,
    scrape,
    self_signed_certificate,
    serving,
    tiny_chat_tokenizer,
    wait_for,
)

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("prometheus_client")

from vaswani.data.tokenization import train_tokenizer  # noqa: E402
from vaswani.runtime import OrtModelForCausalLM, default_session_options  # noqa: E402
from vaswani.serving import SamplingParams, create_app, load_service  # noqa: E402
from vaswani.serving.scheduler import Scheduler  # noqa: E402
from vaswani.serving.text import TextStream  # noqa: E402

MODEL = "tiny-chat"
LONG = CONTEXT - 100  # tokens: seconds of decoding for the tiny model, so a request is surely in flight


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def folders(tiny_chat_pair):
    """(PyTorch folder, its ONNX export): the session's tiny chat pair, read and never written here."""
    return tiny_chat_pair["pytorch"], tiny_chat_pair["onnx"]


@pytest.fixture(scope="module")
def offline(folders):
    return OrtModelForCausalLM.from_pretrained(folders[1], session_options=default_session_options(1))


def new_service(folders, **options):
    """A service of its own: an app's shutdown stops its engine, so apps do not share one."""
    return load_service(folders[1], threads=1, **options)


def slowed(service):
    """`service` with decoding steps of at least 10 ms, so that LONG tokens take far longer than a test's half-second
    deadline on any machine (the tiny model decoded them in under half a second on an AMX Xeon, and a stream meant to
    be cut finished first)."""
    step = service.scheduler.batch.step
    service.scheduler.batch.step = lambda tokens: (time.sleep(0.01), step(tokens))[1]
    return service


def chat_body(question: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0, **fields}


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


# ---------------------------------------------------------------------------------- lifecycle: disconnects, SIGTERM


def test_sigterm_drains_a_running_stream_and_a_vanished_non_streamed_client_holds_nothing(folders, tmp_path):
    """`vaswani serve` as a process (over HTTPS where openssl can make a certificate): a non-streamed client that
    goes away frees its row and its handler (on main the handler waited forever for an event that never came, and the
    server still ran 15 s after SIGTERM); SIGTERM then lets a running stream finish and the process exits, long
    before its 60 s grace period."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vaswani.cli.main",
        "serve",
        str(folders[1]),
        "--port",
        str(port),
        "--threads",
        "1",
    ]
    command += ["--model-name", MODEL, "--shutdown-timeout", "60", "--log-level", "info"]
    tls = self_signed_certificate(tmp_path)
    if tls is not None:
        command += ["--ssl-keyfile", str(tls[0]), "--ssl-certfile", str(tls[1])]
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        with httpx.Client(base_url=url, verify=str(tls[1]) if tls else True, timeout=30) as http:

            def health():
                try:
                    return http.get("/health").json()
                except httpx.TransportError:
                    return None

            assert wait_for(lambda: health() is not None or process.poll() is not None, timeout=90)
            assert process.poll() is None, Path(log.name).read_text()

            # A non-streamed request for 16 x 1900 tokens, whose client goes away as soon as its rows run.
            body = json.dumps(chat_body("Tell me everything.", max_tokens=LONG, ignore_eos=True, n=16)).encode()
            connection = socket.create_connection(("127.0.0.1", port), timeout=10)
            if tls is not None:
                context = ssl.create_default_context(cafile=str(tls[1]))
                connection = context.wrap_socket(connection, server_hostname="127.0.0.1")
            connection.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert wait_for(lambda: health()["running"] > 0, timeout=10)
            connection.close()
            assert wait_for(lambda: health()["running"] == 0, timeout=10), "the rows of the vanished client stayed"

            # A stream is running when SIGTERM comes: it is served to its end, then the process exits.
            streamed = chat_body("Go on.", max_tokens=600, ignore_eos=True, stream=True)
            with http.stream("POST", "/v1/chat/completions", json=streamed) as response:
                lines = response.iter_lines()
                assert [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        process.wait(timeout=15)
        assert time.monotonic() - signalled < 15
        assert process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = Path(log.name).read_text()
    scheme = "https" if tls else "http"
    assert f"vaswani serve: model '{MODEL}' from {folders[1].resolve()} (onnx on cpu, text-generation" in output
    assert f"1 intra-op threads) at {scheme}://127.0.0.1:{port}/v1" in output
    assert '"POST /v1/chat/completions" 200' in output  # the access log, one line per request


def test_past_the_shutdown_grace_a_running_stream_is_cut_and_the_server_exits(folders):
    """uvicorn's `timeout_graceful_shutdown` (`--shutdown-timeout`): a stream still running when the grace ends is
    cancelled, its row freed, and the engine stopped with the app."""
    import uvicorn

    service = slowed(new_service(folders))
    config = uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning")
    config.timeout_graceful_shutdown = 0.5
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    received = []
    with httpx.Client(base_url=url, timeout=30) as http:
        body = chat_body("Go on.", max_tokens=LONG, ignore_eos=True, stream=True)
        with pytest.raises(httpx.HTTPError), http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                received.append(line)
                if len(received) == 6:
                    server.should_exit = True
                    stopping = time.monotonic()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - stopping < 5
    assert "data: [DONE]" not in received  # cut, not finished
    assert not service.scheduler.alive and service.scheduler.stats()["running"] == 0


def test_a_cancelled_sequence_ends_with_a_final_event(folders, offline, tokenizer):
    """`Scheduler.cancel` ends a running sequence with one final "abort" event (main sent none, so its owner waited
    forever), and a cancelled waiting sequence is never prefilled: the group formed after it holds only the others."""
    engine = new_service(folders, max_batch=4).scheduler
    groups, next_group = [], engine._next_group

    def recording_next_group():
        group = next_group()
        groups.append(list(group.rows))
        return group

    engine._next_group = recording_next_group
    events = {name: [] for name in ("waiting", "kept", "running")}
    finished = threading.Semaphore(0)

    def emitter(name):
        def emit(event):
            events[name].append(event)
            if event.finish_reason:
                finished.release()

        return emit

    prompt = chat_prompt(tokenizer, "Hi")
    waiting = engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0), emitter("waiting"))
    engine.submit(prompt, SamplingParams(max_tokens=5, temperature=0), emitter("kept"))
    engine.cancel(waiting)  # before the engine forms its first group
    engine.start()
    try:
        running = engine.submit(prompt, SamplingParams(max_tokens=LONG, temperature=0), emitter("running"))
        assert wait_for(lambda: len(events["running"]) >= 3)
        engine.cancel(running)
        for _ in range(3):
            assert finished.acquire(timeout=10)
    finally:
        engine.stop()
    assert [(event.token, event.finish_reason) for event in events["waiting"]] == [(None, "abort")]
    assert groups and not any(waiting in group for group in groups)  # never prefilled
    assert [event.token for event in events["kept"]] == offline_answer(offline, tokenizer, prompt, 5)[1]
    reasons = [event.finish_reason for event in events["running"] if event.finish_reason]
    assert reasons == ["abort"]
    assert wait_for(lambda: engine.stats()["running"] == 0)


def test_busy_and_stats_read_the_prefill_group_once():
    """`busy` and `stats` read the prefilling group once: the engine thread may clear it between two reads (main
    read it twice, and a thread switch between the reads raised AttributeError under load). The engine here clears
    it right after every read, as the worst-timed switch would."""

    class ClearedAfterEachRead(Scheduler):
        @property
        def prefilling(self):
            group, self._group = self._group, None
            return group

        @prefilling.setter
        def prefilling(self, group):
            self._group = group

    class Group:
        rows = [object(), object()]

    class NoModel:
        def new_batch(self) -> list:  # an empty batch, where the engine asks its model for one
            return []

    engine = ClearedAfterEachRead(NoModel())  # never started
    engine.prefilling = Group()
    assert engine.busy == 2
    engine.prefilling = Group()
    assert engine.stats()["prefilling"] == 2


# -------------------------------------------------------------------------------------------------- the watchdog


class EngineKilled(BaseException):
    """Escapes the loop's `except Exception`, as a bug in the loop itself would: the engine thread dies."""


def test_when_the_engine_thread_dies_health_is_503_and_requests_fail_fast(folders, monkeypatch):
    service = new_service(folders, max_batch=1, max_waiting=8)

    def killed(*args, **kwargs):
        raise EngineKilled("the test killed the engine thread")

    monkeypatch.setattr(service.scheduler, "_iteration", killed)
    with serving(create_app(service)) as running, httpx.Client(base_url=running.url, timeout=10) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        answers = []

        def ask():
            answers.append(http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=LONG, ignore_eos=True)))

        started = time.monotonic()
        askers = [threading.Thread(target=ask) for _ in range(3)]  # one prefilling, two waiting when it dies
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(timeout=10)
        assert [answer.status_code for answer in answers] == [503] * 3
        assert time.monotonic() - started < 5
        assert "EngineKilled" in answers[0].json()["error"]["message"]

        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unavailable" and "EngineKilled" in health.json()["error"]
        started = time.monotonic()
        late = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert late.status_code == 503 and time.monotonic() - started < 1
        assert late.json()["error"]["code"] == "engine_unavailable"
        metrics = http.get("/metrics").text
        assert "vaswani_engine_alive 0.0" in metrics


# ------------------------------------------------------------------------------------------- the event loop stays free


def test_a_body_over_the_limit_gets_413_unread_and_health_answers_meanwhile(folders):
    service = new_service(folders)
    templating_threads = []

    original = service.chat_prompt

    def chat_prompt(messages, tools=None):
        templating_threads.append(threading.current_thread())
        return original(messages, tools)

    service.chat_prompt = chat_prompt
    with serving(create_app(service)) as running:
        port = int(running.url.rsplit(":", 1)[1])
        # Content-Length says 3 MB: the answer comes before a byte of the body is sent.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 3000000\r\n\r\n"
            )
            reply = raw.recv(65536).decode()
        head, _, body = reply.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 413")
        error = json.loads(body)["error"]
        assert "1048576 bytes" in error["message"] and "--max-body-bytes" in error["message"]

        # A chunked body (no Content-Length) is read only up to the limit.
        def chunks():
            yield b'{"model": "tiny-chat", "prompt": "'
            for _ in range(48):
                yield b"a" * 65536

        chunked = httpx.post(running.url + "/v1/completions", content=chunks(), timeout=10)
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"

        # A large prompt under the limit: its chat template and tokenization run off the event loop (main ran them on
        # it, and held /health for seconds), so /health answers meanwhile; the tokenizer's own hold of the GIL while
        # it builds the 600k ids (some 100 ms here) is all that can delay it.
        big = chat_body("Once upon a time there was a cat. " * 28_000)  # 0.95 MB
        slowest, done = 0.0, threading.Event()
        result = []

        def send_big():
            result.append(httpx.post(running.url + "/v1/chat/completions", json=big, timeout=60))
            done.set()

        sender = threading.Thread(target=send_big)
        sender.start()
        with httpx.Client(base_url=running.url, timeout=10) as http:
            while not done.is_set():
                started = time.monotonic()
                assert http.get("/health").status_code == 200
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.01)
        sender.join()
        assert result[0].status_code == 400 and "maximum context length" in result[0].json()["error"]["message"]
        assert templating_threads and running.thread not in templating_threads
        assert slowest < 1.0, f"/health took {slowest:.2f} s while a large prompt was tokenized"


def byte_level_tokenizer():
    """A byte-level BPE whose small vocabulary splits emoji and CJK characters across tokens."""
    texts = ["The cat sat on the mat. 猫が座った。小猫在垫子上。 🐈 🙂 👍🏽 café naïve"] * 20
    return train_tokenizer(texts, vocab_size=300)


@pytest.mark.parametrize("kind", ["chat", "byte-level"])
def test_text_stream_decodes_incrementally_and_adds_up_to_the_whole_decode(tokenizer, kind):
    """The deltas add up to `decode(all tokens)` (no U+FFFD halves of a character on the way), and each token
    decodes a window of a few tokens, however long the answer: main decoded the whole answer for every token."""
    chosen = tokenizer if kind == "chat" else byte_level_tokenizer()
    text = "Once upon a time, 猫 met a 🐈 café owner; they said “naïve” 👍🏽 and left. " * 40
    tokens = chosen(text)["input_ids"]
    if kind == "chat":
        tokens = tokens[:50] + [chosen.eos_token_id] + tokens[50:]  # a special token mid-answer is skipped
    assert any("\ufffd" in chosen.decode([token]) for token in tokens)  # characters do span tokens
    windows = []
    decode = chosen.decode

    def counting_decode(ids, **kwargs):
        windows.append(len(ids))
        return decode(ids, **kwargs)

    stream = TextStream(chosen)
    stream.tokenizer = copy.copy(chosen)
    stream.tokenizer.decode = counting_decode
    pieces = [stream.add(token) for token in tokens] + [stream.flush()]
    assert "".join(pieces) == chosen.decode(tokens, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(tokens) > 1000 and max(windows) <= 8


@pytest.mark.parametrize("kind", ["chat", "byte-level"])
def test_text_stream_of_random_tokens_adds_up_to_the_whole_decode(tokenizer, kind):
    """Any token sequence a sampler can draw, invalid UTF-8 included (its replacement characters sent at the end):
    windowed decoding never drops, repeats or reorders text."""
    chosen = tokenizer if kind == "chat" else byte_level_tokenizer()
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(len(chosen)) for _ in range(rng.randrange(1, 60))]
        stream = TextStream(chosen)
        pieces = [stream.add(token) for token in tokens] + [stream.flush()]
        assert "".join(pieces) == chosen.decode(tokens, skip_special_tokens=True), tokens


def test_text_stream_stops_at_a_stop_string_spanning_multi_byte_tokens():
    chosen = byte_level_tokenizer()
    text = "The cat sat. 猫が座った。 🐈 then more text that must not come."
    tokens = chosen(text)["input_ids"]
    for stop in ["座った", "🐈", "sat."]:
        stream = TextStream(chosen, [stop])
        pieces = [stream.add(token) for token in tokens] + [stream.flush()]
        assert "".join(pieces) == text[: text.find(stop)] and stream.stopped


def test_request_timeout_ends_the_answer_with_length_and_the_text_so_far(folders, tokenizer):
    with serving(create_app(slowed(new_service(folders)), request_timeout=0.5)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
        for stream in (False, True):
            started = time.monotonic()
            ask = dict(model=MODEL, messages=[{"role": "user", "content": "Go on."}], max_tokens=LONG, temperature=0)
            if stream:
                chunks = list(client.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}))
                text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
                reason = chunks[-1].choices[0].finish_reason
            else:
                reply = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
                text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
                assert 0 < reply.usage.completion_tokens < LONG
            assert time.monotonic() - started < 3
            assert reason == "length" and text


# ------------------------------------------------------------------------------------------------------ operators


def test_chat_template_raise_exception_is_a_400_naming_its_message(folders, tokenizer):
    service = new_service(folders)
    service.tokenizer = copy.deepcopy(tokenizer)
    service.tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System messages are not supported by this template') }}{% endif %}"
        "{{ message['content'] }}{% endfor %}"
    )
    with serving(create_app(service)) as running:
        body = chat_body("Hi") | {"messages": [{"role": "system", "content": "Be brief."}]}
        response = httpx.post(running.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "System messages are not supported by this template" in error["message"]
        assert error["param"] == "messages"
        assert httpx.post(running.url + "/v1/chat/completions", json=chat_body("Hi", max_tokens=2)).status_code == 200


def test_api_key_is_required_on_the_api_and_health_and_metrics_stay_open(folders, offline, tokenizer):
    app = create_app(new_service(folders), api_key="s3cret", allowed_origins=["https://good.example"])
    with serving(app) as running, httpx.Client(base_url=running.url, timeout=30) as http:
        body = chat_body("Hi", max_tokens=4)
        missing = http.post("/v1/chat/completions", json=body)
        wrong = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        for response in (missing, wrong, http.get("/v1/models")):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert "s3cret" not in wrong.text
        right = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200

        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="nope").models.list()
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="s3cret")
        expected, _ = offline_answer(offline, tokenizer, chat_prompt(tokenizer, "Hi"), 4)
        reply = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=4, temperature=0)
        assert reply.choices[0].message.content == expected

        # CORS: a browser's preflight (no credentials) is answered for the allowed origin only, and the origin may
        # read the answers, 401s included.
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        good = http.options("/v1/chat/completions", headers={"Origin": "https://good.example", **preflight})
        assert good.status_code == 200
        assert good.headers["access-control-allow-origin"] == "https://good.example"
        bad = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        unauthorized = http.post("/v1/chat/completions", json=body, headers={"Origin": "https://good.example"})
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == "https://good.example"


def test_request_ids_are_honoured_or_made_and_each_request_is_logged(folders, caplog):
    caplog.set_level("INFO", logger="vaswani.serving.access")
    with serving(create_app(new_service(folders))) as running, httpx.Client(base_url=running.url) as http:
        sent = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
            headers={"X-Request-Id": "client-42"},
        )
        assert sent.status_code == 200 and sent.headers["x-request-id"] == "client-42"
        made = http.get("/health")
        assert len(made.headers["x-request-id"]) == 32
        hostile = http.get("/health", headers={"X-Request-Id": "x" * 500})
        assert hostile.headers["x-request-id"] != "x" * 500
        missing = http.get("/nowhere", headers={"X-Request-Id": "lost-1"})
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "lost-1"
    lines = [record.getMessage() for record in caplog.records if record.name == "vaswani.serving.access"]
    assert any(line.startswith("client-42 ") and '"POST /v1/completions" 200' in line for line in lines)
    assert any(line.startswith(made.headers["x-request-id"]) and '"GET /health" 200' in line for line in lines)
    assert any(line.startswith("lost-1 ") and " 404 " in line for line in lines)


def test_metrics_move_with_traffic(folders, tokenizer):
    with serving(create_app(new_service(folders))) as running, httpx.Client(base_url=running.url, timeout=30) as http:
        before = scrape(http)
        reply = http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=8, ignore_eos=True))
        assert reply.status_code == 200
        assert http.post("/v1/chat/completions", json=chat_body("Hi", max_tokens=-1)).status_code == 400
        http.get("/nowhere/" + "x" * 40)
        after = scrape(http)

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("vaswani_requests_total", route="/v1/chat/completions", status="200") == 1
    assert moved("vaswani_requests_total", route="/v1/chat/completions", status="400") == 1
    assert moved("vaswani_requests_total", route="other", status="404") == 1  # unknown paths share one label
    assert moved("vaswani_prompt_tokens_total") == len(chat_prompt(tokenizer, "Hi"))
    assert moved("vaswani_generation_tokens_total") == 8
    assert moved("vaswani_time_to_first_token_seconds_count") == 1
    assert moved("vaswani_inter_token_latency_seconds_count") == 7
    assert moved("vaswani_batch_size_count") >= 7  # a decoding step per token after the first
    assert moved("vaswani_batch_size_sum") == moved("vaswani_batch_size_count")  # each with the one sequence
    assert after[("vaswani_running_sequences", ())] == 0 and after[("vaswani_engine_alive", ())] == 1
    ttft = after[("vaswani_time_to_first_token_seconds_sum", ())] - before.get(
        ("vaswani_time_to_first_token_seconds_sum", ()), 0.0
    )
    assert 0 < ttft < 10


def test_each_app_has_its_own_metrics_registry(folders):
    first, second = create_app(new_service(folders)), create_app(new_service(folders))
    assert first.state.metrics.registry is not second.state.metrics.registry
    first.state.metrics.requests.labels("/health", "200").inc()
    labels = {"route": "/health", "status": "200"}
    assert first.state.metrics.registry.get_sample_value("vaswani_requests_total", labels) == 1
    assert second.state.metrics.registry.get_sample_value("vaswani_requests_total", labels) is None
