"""The server's prefix cache and token budget.

The prefix cache, on every decoder runtime it serves: the GroupQueryAttention batch (an int8 export), the
portable batch (an fp32 export), PyTorch (`TorchStepModel`) and OpenVINO (`engine="openvino"`).

Oracle: the same scheduler over the same step model with the cache off. A request served from cached keys and values
must get the same tokens, and log probabilities within the spread that batching alone gives the cache-off server (the
same request prefilled alone and beside others), for: a shared prefix reused by later requests, requests sharing a
prefix at the same time, a prefix ending inside a block, a prompt cached whole, a chat's next turn (its answer cached
when it left), and eviction under a budget of a few blocks. The tokens found are those a prompt shares with the
sequences served before it, to the token.

The token budget (`max_num_batched_tokens`): a long prompt arriving while streams run is fed in chunks, each beside a
decoding step of the running streams, and no iteration computes more tokens than the budget (the scheduler's own step
log); the answers equal those of a server whose budget takes the prompt in one call.
"""

import threading
import time

import httpx
import numpy as np
import pytest
from serving_cases import scrape, serving, tiny_chat_tokenizer, tiny_gqa_chat_folder

from vaswani.cli.main import main as vaswani
from vaswani.cli.serve import byte_size
from vaswani.data import corpus_stories
from vaswani.export import trace_onnx
from vaswani.modeling import VaswaniForCausalLM
from vaswani.runtime import OrtModelForCausalLM, default_session_options
from vaswani.serving import SamplingParams, create_app, load_service
from vaswani.serving.batches import TorchStepModel
from vaswani.serving.prefix_cache import PrefixCache
from vaswani.serving.scheduler import Scheduler

RUNTIMES = ["gqa", "portable", "torch", "openvino"]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer) -> dict:
    """The tiny chat model's PyTorch folder ("torch"), its int8 export ("gqa") and its fp32 export ("portable")."""
    root = tmp_path_factory.mktemp("prefix-cache")
    folders = {"torch": tiny_gqa_chat_folder(root, tokenizer), "gqa": root / "int8", "portable": root / "fp32"}
    traced = trace_onnx(folders["torch"], task="text-generation")
    traced.export(folders["gqa"], validate=False, quantize="int8")
    traced.export(folders["portable"], validate=False)
    traced.close()
    return folders


@pytest.fixture(scope="module")
def step_models(folders):
    """step_model(runtime): a fresh step model of the tiny chat model on that runtime."""
    options = dict(session_options=default_session_options(1))

    def step_model(runtime: str):
        if runtime == "torch":
            return TorchStepModel(VaswaniForCausalLM.from_pretrained(folders["torch"]))
        if runtime == "openvino":
            pytest.importorskip("openvino")
            # f32 compute: the oracle (answers equal to the cache-off server's) needs arithmetic that does not depend
            # on how many tokens a call holds, which OpenVINO's bf16 kernels (its "auto" on CPUs with bfloat16) are not
            # (a cached prefix's rest computed alone rounds otherwise than within the whole prompt).
            model = OrtModelForCausalLM.from_pretrained(
                folders["portable"], engine="openvino", openvino_precision="f32", **options
            )
        else:
            model = OrtModelForCausalLM.from_pretrained(folders[runtime], **options)
        assert model.decoder_runtime.name == runtime
        return model.decoder_runtime.step_model()

    return step_model


@pytest.fixture(scope="module")
def texts(tokenizer):
    """Token ids of corpus stories: a long shared prefix (several blocks, ending inside one) and distinct endings."""
    stories = [tokenizer(story, add_special_tokens=False).input_ids for story in corpus_stories()[200:240]]
    stories = [ids for ids in stories if len(ids) >= 60]
    return stories


class Server:
    """A running scheduler whose requests are sent in waves: each wave's requests submitted together, and the next
    wave sent once every answer of this one is complete."""

    def __init__(self, step_model, cache: PrefixCache | None, max_batch: int = 4):
        self.cache = cache
        self.scheduler = Scheduler(step_model, max_batch=max_batch, max_num_batched_tokens=64, prefix_cache=cache)
        self.scheduler.start()
        self.max_bytes_seen = 0

    def wave(self, prompts: list[list[int]], max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
        results, errors = [([], []) for _ in prompts], []
        finished = threading.Semaphore(0)

        def emitter(index):
            def emit(event):
                if event.token is not None:
                    results[index][0].append(event.token)
                    results[index][1].append(event.logprobs.logprob)
                if event.finish_reason is not None:
                    errors.append(event.error)
                    finished.release()

            return emit

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
        for index, prompt in enumerate(prompts):
            self.scheduler.submit(prompt, params, emitter(index))
        for _ in prompts:
            assert finished.acquire(timeout=60)
        assert errors == [None] * len(prompts)
        if self.cache is not None:
            self.max_bytes_seen = max(self.max_bytes_seen, self.cache.bytes)
        return results

    def stop(self):
        self.scheduler.stop()


def assert_same_answers(cached, plain, spread):
    for (tokens, logprobs), (expected, expected_logprobs) in zip(cached, plain):
        assert tokens == expected
        np.testing.assert_allclose(logprobs, expected_logprobs, rtol=0, atol=spread)


def batching_spread(step_model, prompts: list[list[int]]) -> float:
    """The largest log-probability difference batching alone makes with the cache off: each prompt prefilled alone
    against all prompts prefilled together (a tolerance from the oracle's own variation, floored at float32's)."""
    server = Server(step_model, None)
    try:
        alone = [server.wave([prompt])[0] for prompt in prompts]
        together = server.wave(prompts)
    finally:
        server.stop()
    differences = [np.abs(np.subtract(a[1], b[1])).max() for a, b in zip(alone, together)]
    return 4 * max(max(differences), 1e-5)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_prefix_cached_answers_equal_uncached_ones(runtime, step_models, texts):
    step_model = step_models(runtime)
    cache = PrefixCache.for_model(step_model, 1 << 30)
    block = cache.block_size  # 16; OpenVINO's paged batch shares its own blocks of 32
    system = texts[0][: 3 * block + 5]  # 3 whole blocks and 5 tokens of a fourth
    shared = [system + ending[: block + 4] for ending in texts[1:4]]
    inside = texts[0][: 2 * block + 5] + texts[5][:10]  # shares 2 whole blocks and 5 tokens of the third
    first_turn = texts[6][: 2 * block + 8]
    waves = [
        [shared[0]],  # computes the shared prefix
        shared[1:3],  # both reuse it, at the same time
        [inside],
        [shared[1][: 4 * block]],  # cached whole (4 blocks): only its last token is computed
        [shared[2], texts[8][:50]],  # one group: a long cached prefix with a short rest beside a long new prompt
        [first_turn],
    ]
    plain_server, cached_server = Server(step_model, None), Server(step_model, cache)
    try:
        plain = [plain_server.wave(wave) for wave in waves]
        cached = [cached_server.wave(wave) for wave in waves]
        # The chat's next turn: its first turn, the answer, and more (the answer's blocks were stored when it left).
        next_turn = first_turn + plain[-1][0][0] + texts[7][:12]
        plain.append(plain_server.wave([next_turn]))
        hits_before = cached_server.cache.hit_tokens
        cached.append(cached_server.wave([next_turn]))
        next_turn_hit = cached_server.cache.hit_tokens - hits_before
    finally:
        plain_server.stop()
        cached_server.stop()
    spread = batching_spread(step_model, [shared[0], inside, next_turn])
    for cached_wave, plain_wave in zip(cached, plain):
        assert_same_answers(cached_wave, plain_wave, spread)
    # Hits: each prompt finds the longest start it shares with a sequence an earlier wave fed (its prompt and answer
    # but the last token, stored when it left), all but its last token at most. Token by token: a prompt parting
    # from a cached one inside a block reuses the tokens of that block they share.
    fed, expected = [], []
    for wave, answers in zip([*waves, [next_turn]], plain):
        expected += [
            min(len(prompt) - 1, max((common_length(prompt, seen) for seen in fed), default=0)) for prompt in wave
        ]
        fed += [prompt + tokens[:-1] for prompt, (tokens, _) in zip(wave, answers)]
    assert expected[1] >= 3 * block + 5 and expected[4] == 4 * block - 1  # the shared prefix; the prompt cached whole
    assert cache.hit_tokens == sum(expected)
    assert next_turn_hit == expected[-1] == len(first_turn) + len(plain[-2][0][0]) - 1  # the whole previous turn
    assert cache.queried_tokens == sum(len(p) for wave in waves for p in wave) + len(next_turn)


def common_length(first: list[int], second: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


@pytest.mark.parametrize("runtime", ["gqa", "portable", "openvino"])
def test_eviction_under_a_tiny_budget_serves_nothing_wrong_and_stays_under_it(runtime, step_models, texts):
    step_model = step_models(runtime)
    probe = PrefixCache.for_model(step_model, 1 << 30)
    block = probe.block_size
    server = Server(step_model, probe)
    try:
        server.wave([texts[0][:block]], max_tokens=1)  # one whole block, stored as the prompt ends
    finally:
        server.stop()
    block_bytes = probe.bytes  # one block's keys and values
    # Two texts in turn, each sent twice in a row (the second time longer): 2 whole blocks and a partial one each,
    # one text's kept at a time, evicted by the other's.
    prompts = [texts[(i // 2) % 2][: 2 * block + 1 + i] for i in range(8)]
    cache = PrefixCache.for_model(step_model, 3 * block_bytes)
    plain_server, cached_server = Server(step_model, None), Server(step_model, cache)
    try:
        plain = [plain_server.wave([prompt]) for prompt in prompts]
        cached = [cached_server.wave([prompt]) for prompt in prompts]
    finally:
        plain_server.stop()
        cached_server.stop()
    spread = batching_spread(step_model, prompts[:3])
    for cached_wave, plain_wave in zip(cached, plain):
        assert_same_answers(cached_wave, plain_wave, spread)
    assert cached_server.max_bytes_seen <= 3 * block_bytes and cache.bytes <= 3 * block_bytes
    assert cache.evicted_blocks > 0 and cache.hit_tokens > 0


def long_prompt_beside_streams(step_model, budget: int, streams: list[list[int]], long_prompt: list[int]):
    """The answers of two streams and of a long prompt sent once both stream, and the step log from then on. The long
    prompt is submitted from the scheduler thread itself, in the iteration that gives both streams their third token,
    so that it arrives at the same step whatever the machine's load (sent from the test's thread, it once arrived
    after a stream had finished, on a loaded 2-core machine)."""
    scheduler = Scheduler(step_model, max_batch=4, max_num_batched_tokens=budget)
    results, finished, joined = [[] for _ in range(3)], threading.Semaphore(0), []

    def emitter(index):
        def emit(event):
            results[index].append(event.token)
            if index < 2 and not joined and all(len(results[stream]) >= 3 for stream in range(2)):
                joined.append(len(scheduler.step_log))  # this iteration is logged after its tokens are emitted
                scheduler.submit(long_prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), emitter(2))
            if event.finish_reason is not None:
                finished.release()

        return emit

    scheduler.start()
    try:
        for index, prompt in enumerate(streams):
            scheduler.submit(prompt, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True), emitter(index))
        for _ in range(3):
            assert finished.acquire(timeout=60)
    finally:
        scheduler.stop()
    return results, list(scheduler.step_log)[joined[0] :]


@pytest.mark.parametrize("runtime", ["gqa", "portable", "openvino"])
def test_a_long_prompt_joins_running_streams_in_chunks_within_the_token_budget(runtime, step_models, texts):
    """OpenVINO's paged batch computes each chunk in the same call as the streams' decoding step
    (`Scheduler._fused_step`); its answers are also the portable runtime's, which runs the same fp32 graph apart."""
    step_model, budget = step_models(runtime), 24
    streams = [texts[1][:20], texts[2][:25]]
    long_prompt = [token for text in texts[3:12] for token in text][:400]
    answers, log = long_prompt_beside_streams(step_model, budget, streams, long_prompt)
    whole_answers, _ = long_prompt_beside_streams(step_model, 512, streams, long_prompt)
    assert answers == whole_answers
    if runtime == "openvino":
        assert hasattr(step_model.new_batch(), "step_with_prefill")
        assert answers == long_prompt_beside_streams(step_models("portable"), budget, streams, long_prompt)[0]
    # The long prompt went in chunks of at most the budget less the running streams' tokens, each iteration beside a
    # decoding step of both streams (a stream's longest gap: one chunk), never over the budget.
    chunks = [(fed, decoded) for fed, decoded in log if fed]
    assert sum(fed for fed, _ in chunks) == len(long_prompt), log
    assert len(chunks) >= len(long_prompt) // budget
    assert all(decoded >= 2 for _, decoded in chunks[:-1])
    assert all(fed + decoded <= budget for fed, decoded in log)
    # The long prompt's rows decode in its last chunk's iteration where it ran apart, from the next one where fused.
    assert chunks[-1][1] == (2 if runtime == "openvino" else 3), log


def test_served_prefix_cache_reports_its_hits_in_metrics_and_health(folders, tokenizer):
    """Two completions sharing a 48-token beginning through the HTTP server: the second one's hits are counted in
    /metrics (prometheus' own parser) and /health, as the cache itself counts them; with the cache off, no metrics."""
    stories = corpus_stories()[200:203]
    prompts = [stories[0][:300] + " " + story[:80] for story in stories[1:]]
    service = load_service(folders["gqa"], threads=1, name="tiny", prefix_cache_bytes=1 << 24)
    with serving(create_app(service)) as server, httpx.Client(base_url=server.url) as http:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
        # A finished sequence's tokens are stored as it leaves the batch, just after its answer is sent.
        deadline = time.monotonic() + 30
        while service.scheduler.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not service.scheduler.busy
        metrics, health = scrape(http), http.get("/health").json()
    cache = service.scheduler.prefix_cache
    assert cache.hit_tokens >= 48
    assert metrics[("vaswani_prefix_cache_hits_total", ())] == cache.hit_tokens
    assert metrics[("vaswani_prefix_cache_queries_total", ())] == cache.queried_tokens
    assert metrics[("vaswani_prefix_cache_bytes", ())] == cache.bytes > 0
    assert health["prefix_cache"]["hit_tokens"] == cache.hit_tokens
    off = load_service(folders["gqa"], threads=1, name="tiny", prefix_cache_bytes=0)
    assert off.scheduler.prefix_cache is None
    with serving(create_app(off)) as server, httpx.Client(base_url=server.url) as http:
        assert not any(name.startswith("vaswani_prefix_cache") for name, _ in scrape(http))


def test_usage_reports_the_prompt_tokens_the_cache_supplied(folders, tokenizer):
    """`usage.prompt_tokens_details.cached_tokens`, as OpenAI and vLLM report it: 0 for a prompt the cache has not
    seen (with n=2, the prompt counted once, by its first choice), then, for the same prompt again, whole or streamed,
    every token but the last (which is always computed, for its logits), its partial last block's included; 0 with the
    cache off."""
    ids = tokenizer(corpus_stories()[210][:400])["input_ids"][:70]
    reused = len(ids) - 1  # 4 whole blocks of 16 and 5 of the 6 tokens of a fifth

    def cached_tokens(http, **extra) -> int:
        body = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0, **extra}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if not extra.get("stream"):
            usage = response.json()["usage"]
        else:
            chunks = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: {")]
            usage = httpx.Response(200, content=chunks[-1]).json()["usage"]
        assert usage["prompt_tokens"] == len(ids)
        return usage["prompt_tokens_details"]["cached_tokens"]

    service = load_service(folders["gqa"], threads=1, name="tiny", prefix_cache_bytes=1 << 24)
    with serving(create_app(service)) as server, httpx.Client(base_url=server.url) as http:
        assert cached_tokens(http, n=2) == 0
        assert cached_tokens(http) == reused
        assert cached_tokens(http, stream=True, stream_options={"include_usage": True}) == reused
    off = load_service(folders["gqa"], threads=1, name="tiny", prefix_cache_bytes=0)
    with serving(create_app(off)) as server, httpx.Client(base_url=server.url) as http:
        assert [cached_tokens(http) for _ in range(2)] == [0, 0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prefix-cache-bytes", "lots"], "'lots' is not a size"),
        (["--max-num-batched-tokens", "8", "--max-batch", "16"], "must be at least max_batch"),
    ],
)
def test_bad_budget_or_cache_size_is_refused_with_the_fix(folders, flags, message, capsys):
    try:
        status = vaswani(["serve", str(folders["gqa"]), *flags])
    except SystemExit as exit:  # argparse's refusal of a flag's value
        status = exit.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_cache_sizes_take_units():
    assert [byte_size(text) for text in ("1024", "512MiB", "2GiB", "1.5G", "64kb")] == [
        1024,
        512 << 20,
        2 << 30,
        1_500_000_000,
        64_000,
    ]
