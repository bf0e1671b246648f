"""The HTTP side: FastAPI routes in the OpenAI API's shape over a loaded service (`services.load_service`).

Routes: `GET /health` (200 while the scheduler thread runs, 503 with the reason once it died), `GET /metrics`
(Prometheus), `GET /v1/models`; for a causal LM `POST /v1/chat/completions` and `POST /v1/completions` (streamed as
server-sent events with `stream: true`); for an encoder `POST /v1/embeddings` or `POST /v1/classifications`.
Every error is a 4xx (5xx for a failure inside the model) with OpenAI's error body; a full queue is a 429 with
`Retry-After`, a body over `max_body_bytes` a 413 (answered before the body is read), a request while the scheduler is
down a 503. A client that disconnects, streamed or not, has its sequences cancelled: their rows leave the batch at the
next step and its handler returns at once.

The event loop only moves bytes: chat templates, tokenization and the prompt checks run in a thread pool, and a
stream's text is decoded incrementally (`text.TextStream`), so a large prompt or a long answer never holds `/health`.

    >>> app = create_app(load_service("exported/decoder"), api_key="secret", request_timeout=120)
    >>> uvicorn.run(app, host="127.0.0.1", port=8000)
"""

import asyncio
import base64
import json
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..constraints import CompiledGrammar
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics
from .middleware import ApiKeyCheck, RequestContext
from .protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    error_body,
)
from .responses import (
    TokenEntry,
    chat_logprobs_body,
    chunk_body,
    completion_body,
    new_id,
    text_logprobs_body,
    usage_body,
    usage_chunk_body,
)
from .sampling import TokenLogprobs
from .scheduler import Event, QueueFull, SamplingParams, SchedulerDead, Sequence
from .services import EncoderService, GenerationService
from .text import TextStream

RETRY_AFTER_SECONDS = 1
# Request bodies past this are refused with a 413. A prompt of a 128k-token context is about 0.5 MB of text, or under
# 1 MB as a list of token ids; larger bodies only cost the server time and memory before their 400.
MAX_BODY_BYTES = 1 << 20


def create_app(
    service: GenerationService | EncoderService,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    request_timeout: float | None = None,
) -> FastAPI:
    """The FastAPI app serving `service`; its scheduler starts with the app and stops with it.

    Args:
        api_key: if set, `/v1/...` requests need `Authorization: Bearer <api_key>` (401 otherwise).
        allowed_origins: origins browsers may call the API from (CORS; "*" for any); none by default.
        max_body_bytes: larger request bodies get a 413.
        request_timeout: seconds a generation may take from the request's arrival; then its choices end with
            finish_reason "length" and the text so far (as llama.cpp's server ends an answer past its time limit).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if isinstance(service, GenerationService):
            service.scheduler.start()
        yield
        service.close()

    if max_body_bytes < 1 or (request_timeout is not None and request_timeout <= 0):
        raise ValueError("max_body_bytes and request_timeout must be positive.")
    app = FastAPI(title=f"vaswani serve: {service.name}", lifespan=lifespan)
    app.state.service = service
    app.state.max_body_bytes, app.state.request_timeout = max_body_bytes, request_timeout
    metrics = app.state.metrics = ServerMetrics(service)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        # The process id tells replicas apart behind a router (Ray Serve).
        body = {"status": "ok", "model": service.name, "pid": os.getpid(), **service.stats()}
        scheduler = service.scheduler
        if scheduler is not None and not scheduler.alive:
            # The watchdog's answer: a load balancer or Kubernetes takes the replica out, and restarts it.
            reason = scheduler.failure or (
                "the scheduler is stopping." if scheduler.stopping else "the scheduler is not started."
            )
            return JSONResponse({**body, "status": "unavailable", "error": reason}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        entry = {"id": service.name, "object": "model", "created": 0, "owned_by": "vaswani"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        generation = generation_service(service, body.model, "chat completions")
        messages = [message.template_input() for message in body.messages]
        prompt = await run_in_threadpool(generation.chat_prompt, messages)
        return await answer(request, generation, "chat", body, [prompt], "messages")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        generation = generation_service(service, body.model, "completions")
        prompts = await run_in_threadpool(lambda: [generation.text_prompt(prompt) for prompt in body.prompts])
        return await answer(request, generation, "text", body, prompts, "prompt")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await parse(request, EmbeddingRequest)
        encoder = encoder_service(service, body.model, "embedding")
        vectors, tokens = await run_in_threadpool(encoder.embed, body.texts)
        if body.encoding_format == "base64":
            vectors = [base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode() for vector in vectors]
        data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": service.name, "usage": usage}

    @app.post("/v1/classifications")
    async def classifications(request: Request) -> dict[str, Any]:
        body = await parse(request, ClassificationRequest)
        encoder = encoder_service(service, body.model, "classification")
        results, tokens = await run_in_threadpool(encoder.classify, body.texts)
        data = [{"object": "classification", "index": i, **result} for i, result in enumerate(results)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": service.name, "usage": usage}

    # The first added is the innermost: the key check inside CORS (a 401 carries CORS headers, so a browser can read
    # it; preflights pass), both inside the request context (every answer has its id, log line and count).
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    routes = {route.path for route in app.routes}
    app.add_middleware(RequestContext, metrics=metrics, routes=routes)
    return app


async def parse(request: Request, model: type[BaseModel]) -> Any:
    """The request body as `model`, or a 400 naming the first problem (malformed JSON, an unknown field, a wrong
    type or value); a 413 for a body over the app's `max_body_bytes`."""
    raw = await read_body(request, request.app.state.max_body_bytes)
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "json_invalid":
            message = f"The request body is not valid JSON: {problem['msg']}."
        elif problem["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {where}."
        else:
            message = f"Invalid value for {where or 'the body'}: {problem['msg']}."
        raise OpenAIError(message, param=where or None) from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` bytes: from `Content-Length` before reading any
    of it (a client that sent `Expect: 100-continue` never uploads it), else once the chunks read pass the limit."""
    too_large = OpenAIError(
        f"The request body exceeds this server's limit of {limit} bytes; send a shorter prompt (the operator can "
        "raise the limit with vaswani serve --max-body-bytes).",
        status=413,
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(service: GenerationService | EncoderService, name: str) -> None:
    if name != service.name:
        raise OpenAIError(
            f"The model {name!r} does not exist; this server serves {service.name!r} (see GET /v1/models).",
            status=404,
            param="model",
            type="not_found_error",
            code="model_not_found",
        )


def generation_service(service: Any, name: str, route: str) -> GenerationService:
    check_model(service, name)
    if not isinstance(service, GenerationService):
        raise OpenAIError(f"The model {name!r} is an encoder ({service.kind}); it serves no {route}.", status=400)
    return service


def encoder_service(service: Any, name: str, kind: str) -> EncoderService:
    check_model(service, name)
    if not isinstance(service, EncoderService) or service.kind != kind:
        served = "chat/completions" if isinstance(service, GenerationService) else service.kind + "s"
        raise OpenAIError(f"The model {name!r} serves {served}, not {kind}s.", status=400)
    return service


class LoopDispatcher:
    """Hands scheduler events (from the scheduler thread) to asyncio queues on one event loop, with one wake-up of the loop
    per burst of events: a decoding step emits a token for every running sequence at once, and a wake-up per token
    would cost a write to the loop's self-pipe each."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:
                return  # a wake-up is already scheduled
        self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, item in pending:
            queue.put_nowait(item)


DISPATCHERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDispatcher]" = weakref.WeakKeyDictionary()


def dispatcher() -> LoopDispatcher:
    loop = asyncio.get_running_loop()
    if loop not in DISPATCHERS:
        DISPATCHERS[loop] = LoopDispatcher(loop)
    return DISPATCHERS[loop]


class Answer:
    """The sequences of one request (its `n` choices of each prompt, choice i on `prompts[i]` with `params[i]`) and
    the queue their events arrive on, as (index, event).

    Every sequence ends with one final event (its last token, an error, or the "abort" that `Scheduler.cancel` sends),
    so `events` ends however the request ends: finished, cancelled by a disconnect, past its `timeout`, or failed.
    """

    def __init__(
        self,
        service: GenerationService,
        prompts: list[list[int]],
        params: list[SamplingParams],
        metrics: ServerMetrics | None = None,
        received_at: float | None = None,
        timeout: float | None = None,
    ):
        self.service, self.prompts, self.params, self.metrics = service, prompts, params, metrics
        self.received_at = received_at if received_at is not None else time.perf_counter()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.dispatcher = dispatcher()
        self.sequences: list[Sequence] = []
        self.expired = False
        self.timer = None
        try:
            for index, (prompt, choice_params) in enumerate(zip(prompts, params)):
                emit = self.emitter(index)
                self.sequences.append(service.scheduler.submit(prompt, choice_params, emit))
        except QueueFull:
            self.cancel()
            scheduler = service.scheduler
            # The request's own choices that were queued before the limit are not others' waiting requests.
            others = sum(1 for sequence in list(scheduler.waiting) if sequence not in self.sequences)
            raise OpenAIError(
                f"The server is at capacity: {others} other requests are waiting (the limit is {scheduler.max_waiting}) "
                f"and this one asks for {len(params)} sequences. Retry after {RETRY_AFTER_SECONDS} s.",
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            ) from None
        except SchedulerDead as error:
            self.cancel()
            raise engine_unavailable(str(error)) from None
        if timeout is not None:
            remaining = max(0.0, self.received_at + timeout - time.perf_counter())
            self.timer = asyncio.get_running_loop().call_later(remaining, self.expire)

    def emitter(self, index: int):
        put, queue = self.dispatcher.put, self.queue
        return lambda event: put(queue, (index, event))

    def cancel(self, index: int | None = None) -> None:
        """Cancel one choice's sequence, or (no `index`) all of them and the timer: the request is over."""
        if index is None and self.timer is not None:
            self.timer.cancel()
        for i, sequence in enumerate(self.sequences):
            if index is None or i == index:
                self.service.scheduler.cancel(sequence)

    def expire(self) -> None:
        """The request's time is up: its choices end (with finish_reason "length") as their "abort" events come."""
        self.expired = True
        self.cancel()

    async def events(
        self, streams: list[TextStream]
    ) -> AsyncIterator[tuple[int, str, str | None, tuple[int, TokenLogprobs] | None]]:
        """(choice index, new text, finish reason or None, (token, its log probabilities) where asked for) until every
        choice finished; a stop string cancels its sequence and finishes the choice with "stop". A 503 when the scheduler
        died (or stops) under the request, a 500 when its step failed."""
        finished = [False] * len(self.sequences)
        last: list[float | None] = [None] * len(self.sequences)  # when each choice's latest token came
        pending = len(self.sequences)
        while pending:
            index, event = await self.queue.get()
            if finished[index]:
                continue  # tokens the scheduler made before it saw the cancellation, or its "abort"
            stream = streams[index]
            if event.error is not None:
                if not self.service.scheduler.alive:
                    raise engine_unavailable(event.error)
                raise OpenAIError(f"Generation failed: {event.error}", status=500, type="server_error")
            delta = ""
            if event.token is not None:
                self.observe(index, last)
                # A token that ends the answer (end-of-sequence, stop_token_ids) is counted, not shown (vLLM's way).
                ends_answer = event.finish_reason == "stop" and event.token in self.params[index].ends
                delta = stream.add(event.token, shown=not ends_answer or stream.include_stop)
            reason = event.finish_reason
            if reason == "abort":
                reason = "length" if self.expired else "abort"  # "abort": the client is gone, nobody reads it
            if stream.stopped:
                self.cancel(index)
                reason = "stop"
            if reason is not None:
                delta += stream.flush()
                finished[index] = True
                pending -= 1
            logprobs = (event.token, event.logprobs) if event.logprobs is not None else None
            yield index, delta, reason, logprobs

    def observe(self, index: int, last: list[float | None]) -> None:
        """A token of choice `index` arrived: the time-to-first-token or inter-token latency, the tokens counter."""
        if self.metrics is None:
            return
        now = time.perf_counter()
        if last[index] is None:
            self.metrics.time_to_first_token.observe(now - self.received_at)
        else:
            self.metrics.inter_token_latency.observe(now - last[index])
        self.metrics.generation_tokens.inc()
        last[index] = now


def engine_unavailable(reason: str) -> OpenAIError:
    return OpenAIError(
        f"The server cannot generate: {reason} Retry on another replica, or after the server restarts.",
        status=503,
        type="server_error",
        code="engine_unavailable",
    )


def answer_grammar(service: GenerationService, body: Any) -> CompiledGrammar | None:
    """The request's constraint on its answer, compiled for the model (None: free text); a 400 naming the field that
    carried a constraint this server cannot enforce."""
    try:
        constraint = body.constraint()
    except ValueError as error:
        raise OpenAIError(f"Invalid constraint: {error}.") from None
    if constraint is None:
        return None
    field, grammar = constraint
    try:
        return service.compile(grammar)
    except ValueError as error:
        raise OpenAIError(f"{field}: {error}", param=field) from None
    except ImportError as error:
        raise OpenAIError(f"{field}: this server cannot constrain answers: {error}", param=field) from None


def sampling_params(
    service: GenerationService, body: Any, max_tokens: int, grammar: CompiledGrammar | None = None
) -> list[SamplingParams]:
    """The scheduler's parameters of the request's `n` choices (of one prompt): choice j's seed is seed + j."""
    biases, stop_ids = body.token_biases(), body.stop_token_ids or []
    for field, ids in (("logit_bias", biases or {}), ("stop_token_ids", stop_ids)):
        outside = sorted(token for token in ids if not 0 <= token < service.vocab_size)
        if outside:
            raise OpenAIError(
                f"{field} names token ids outside the vocabulary [0, {service.vocab_size}): {outside[:5]}; "
                "use ids the model's tokenizer gives.",
                param=field,
            )
    if body.min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens ({body.min_tokens}) is more than this answer may have ({max_tokens} tokens: max_tokens, or "
            "what the context leaves); lower min_tokens or raise max_tokens.",
            param="min_tokens",
        )
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                seed=None if body.seed is None else body.seed + index,
                stop_token_ids=service.eos_token_ids,
                ignore_eos=body.ignore_eos,
                logprobs=body.alternatives,
                logit_bias=biases,
                min_tokens=body.min_tokens,
                request_stop_ids=frozenset(stop_ids),
                grammar=grammar,
            )
            for index in range(body.n)
        ]
    except ValueError as error:  # the request model checks the same ranges; this is the scheduler's own guard
        raise OpenAIError(f"Invalid sampling parameters: {error}.") from None


def token_entry(tokenizer: Any, token: int, logprobs: TokenLogprobs) -> TokenEntry:
    """A token's log probabilities with the texts of the token and its alternatives, as the bodies take them."""
    top = [(tokenizer.decode([best]), value) for best, value in logprobs.top]
    return tokenizer.decode([token]), logprobs.logprob, top


def logprobs_body(kind: str, entries: list[TokenEntry], offset: int) -> dict[str, Any]:
    return chat_logprobs_body(entries) if kind == "chat" else text_logprobs_body(entries, offset)


async def answer(
    request: Request, service: GenerationService, kind: str, body: Any, prompts: list[list[int]], param: str
):
    """Generate `body.n` choices for each of `prompts`; choice j of prompt i has index i * n + j, as in OpenAI's API."""
    capacity = service.scheduler.max_batch + service.scheduler.max_waiting
    if len(prompts) * body.n > capacity:
        raise OpenAIError(
            f"This request asks for {len(prompts) * body.n} sequences ({len(prompts)} prompts x n={body.n}); this "
            f"server runs and queues {capacity} at most. Send fewer prompts or a smaller n.",
            param="n",
        )
    grammar = await run_in_threadpool(answer_grammar, service, body)
    choice_prompts, params = [], []
    for prompt in prompts:
        max_tokens = await run_in_threadpool(service.check, prompt, body.token_limit, param)
        choice_prompts += [prompt] * body.n
        params += sampling_params(service, body, max_tokens, grammar)
    state = request.app.state
    received_at = getattr(request.state, "received_at", None)
    run = Answer(service, choice_prompts, params, state.metrics, received_at, state.request_timeout)
    prompt_tokens = sum(map(len, prompts))  # each prompt once, however many choices it has (as OpenAI counts)
    state.metrics.prompt_tokens.inc(prompt_tokens)
    decoding = {
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
    }
    streams = [
        TextStream(service.tokenizer, body.stop, body.include_stop_str_in_output, decoding, body.min_tokens)
        for _ in run.sequences
    ]
    prefixes = [""] * len(choice_prompts)
    if getattr(body, "echo", False):
        decode = service.tokenizer.decode
        prefixes = await run_in_threadpool(lambda: [decode(prompt, **decoding) for prompt in choice_prompts])
    with_logprobs = body.alternatives is not None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            stream_events(run, streams, kind, service.name, prefixes, include_usage, prompt_tokens, with_logprobs),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    watcher = asyncio.create_task(cancel_on_disconnect(request, run))
    try:
        texts, reasons = list(prefixes), [None] * len(streams)
        entries: list[list[TokenEntry]] = [[] for _ in streams]
        async for index, delta, reason, logprobs in run.events(streams):
            texts[index] += delta
            reasons[index] = reason or reasons[index]
            if logprobs is not None:
                entries[index].append(token_entry(service.tokenizer, *logprobs))
    finally:
        watcher.cancel()
        run.cancel()
    usage = usage_body(prompt_tokens, sum(stream.generated for stream in streams))
    bodies = None
    if with_logprobs:
        bodies = [logprobs_body(kind, tokens, len(prefix)) for tokens, prefix in zip(entries, prefixes)]
    return completion_body(
        kind, new_id("chatcmpl" if kind == "chat" else "cmpl"), service.name, list(zip(texts, reasons)), usage, bodies
    )


async def cancel_on_disconnect(request: Request, run: Answer) -> None:
    """Free the sequences of a non-streamed request whose client went away (its body was read, so the next message
    is the disconnect); their "abort" events end the handler's wait."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.cancel()


async def stream_events(
    run: Answer,
    streams: list[TextStream],
    kind: str,
    model: str,
    prefixes: list[str],
    include_usage: bool,
    prompt_tokens: int,
    with_logprobs: bool = False,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer. When the client disconnects, Starlette cancels this generator at
    an await, and `finally` cancels the sequences. A token's log probabilities go out with the chunk that carries its
    text (a token whose text is held back, an incomplete character or a possible stop string, waits for it)."""
    id, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), int(time.time())
    tokenizer = run.service.tokenizer
    pending: list[list[TokenEntry]] = [[] for _ in streams]
    offsets = [len(prefix) for prefix in prefixes]
    try:
        for index in range(len(streams)):
            if kind == "chat":
                yield sse(chunk_body(kind, id, created, model, index, "", role=True))
            elif prefixes[index]:
                yield sse(chunk_body(kind, id, created, model, index, prefixes[index]))
        try:
            async for index, delta, reason, logprobs in run.events(streams):
                if logprobs is not None:
                    pending[index].append(token_entry(tokenizer, *logprobs))
                if delta or reason is not None:
                    body = None
                    if with_logprobs:
                        body = logprobs_body(kind, pending[index], offsets[index])
                        offsets[index] += sum(len(text) for text, _, _ in pending[index])
                        pending[index] = []
                    yield sse(chunk_body(kind, id, created, model, index, delta, reason, logprobs=body))
        except OpenAIError as error:
            yield sse(error.body())
            return
        if include_usage:
            usage = usage_body(prompt_tokens, sum(stream.generated for stream in streams))
            yield sse(usage_chunk_body(kind, id, created, model, usage))
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
