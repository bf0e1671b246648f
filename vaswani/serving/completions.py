"""How a completion request becomes its answer: the request's sequences on the scheduler, their events on the event
loop, and the OpenAI bodies they make, whole or streamed as server-sent events.

Each choice's text goes through a `TextStream` (incremental detokenization, stop strings); with `tools`, through the
model's tool-call format too (`tools.ToolCallFormat`), which turns the calls it writes into OpenAI `tool_calls`, whole
or as streamed deltas. A request's constraint (a JSON schema, a grammar, the tool-call grammar of
`tool_choice: "required"` or a named function) is compiled here, once per request, and every choice's row gets its
own matcher in the sampler.
"""

import asyncio
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..constraints import CompiledGrammar, Grammar
from .metrics import ServerMetrics
from .protocol import ConstraintError, OpenAIError
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
from .services import GenerationService
from .text import TextStream
from .tools import ToolCallFormat

RETRY_AFTER_SECONDS = 1


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

    def cached_prompt_tokens(self, choices: int) -> int:
        """Prompt tokens the prefix cache supplied, each prompt counted once as `prompt_tokens` counts it: its first
        choice's (a later choice of the same prompt finds the blocks the first one stored)."""
        return sum(sequence.cached_tokens for sequence in self.sequences[::choices])

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


@dataclass
class ToolUse:
    """How a chat request's answer uses its tools: the model's tool-call `format`, the tool_choice `mode` ("auto",
    "required", "named") and, for "required" and "named", the `grammar` that holds the answer to calls only."""

    format: ToolCallFormat
    mode: str
    tools: list[dict[str, Any]]
    grammar: Grammar | None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (a named function's forced call ends with "stop")."""
        return "tool_calls" if reason == "stop" and called and self.mode != "named" else reason


def tool_use(service: GenerationService, body: Any) -> ToolUse | None:
    """The request's use of tools (None: it offers none, or tool_choice is "none"); a 400 when the model's tool-call
    format is unknown or tool_choice names a function that is not among the tools."""
    mode = getattr(body, "tool_mode", None)
    if mode is None:
        return None
    tool_format = service.tool_format()
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    grammar = None
    if mode != "auto":
        choice = body.tool_choice.model_dump() if mode == "named" else mode
        # A named function is called once (vLLM's way); "required" calls one or more unless parallel_tool_calls=false.
        parallel = False if mode == "named" else body.parallel_tool_calls
        try:
            grammar = Grammar.lark(tool_format.grammar(tools, choice, parallel))
        except ValueError as error:
            raise OpenAIError(f"tool_choice: {error}", param="tool_choice") from None
    return ToolUse(tool_format, mode, tools, grammar)


def answer_grammar(
    service: GenerationService, body: Any, tools: ToolUse | None = None, metrics: ServerMetrics | None = None
) -> CompiledGrammar | None:
    """The request's constraint on its answer, compiled for the model (None: free text); a 400 naming the field that
    carried a constraint this server cannot enforce. `metrics` count it by field and time its compilation."""
    try:
        constraint = body.constraint()
    except ConstraintError as error:
        raise OpenAIError(f"Invalid constraint: {error}.", param=error.field) from None
    if tools is not None and tools.grammar is not None:
        if constraint is not None:
            raise OpenAIError(
                f"tool_choice {tools.mode!r} constrains the answer to tool calls, so {constraint[0]} cannot apply too; "
                'send one of them (tool_choice "auto" lets the model answer in text).',
                param=constraint[0],
            )
        constraint = ("tool_choice", tools.grammar)
    if constraint is None:
        return None
    field, grammar = constraint
    started = time.perf_counter()
    try:
        compiled = service.compile(grammar)
    except ValueError as error:
        raise OpenAIError(f"{field}: {error}", param=field) from None
    except ImportError as error:
        raise OpenAIError(f"{field}: this server cannot constrain answers: {error}", param=field) from None
    if metrics is not None:
        metrics.grammar_compile.observe(time.perf_counter() - started)
        metrics.constrained_requests.labels(field).inc()
    return compiled


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
    request: Request,
    service: GenerationService,
    kind: str,
    body: Any,
    prompts: list[list[int]],
    param: str,
    tools: ToolUse | None = None,
):
    """Generate `body.n` choices for each of `prompts`; choice j of prompt i has index i * n + j, as in OpenAI's API.
    With `tools`, each chat choice's tool calls are parsed from its text into OpenAI's `tool_calls`."""
    capacity = service.scheduler.max_batch + service.scheduler.max_waiting
    if len(prompts) * body.n > capacity:
        raise OpenAIError(
            f"This request asks for {len(prompts) * body.n} sequences ({len(prompts)} prompts x n={body.n}); this "
            f"server runs and queues {capacity} at most. Send fewer prompts or a smaller n.",
            param="n",
        )
    grammar = await run_in_threadpool(answer_grammar, service, body, tools, request.app.state.metrics)
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
            stream_events(
                run, streams, kind, service.name, prefixes, include_usage, prompt_tokens, with_logprobs, tools, body.n
            ),
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
    usage = usage_body(prompt_tokens, sum(stream.generated for stream in streams), run.cached_prompt_tokens(body.n))
    bodies = None
    if with_logprobs:
        bodies = [logprobs_body(kind, tokens, len(prefix)) for tokens, prefix in zip(entries, prefixes)]
    calls = None
    if tools is not None:
        parsed = [tools.format.parse(text) for text in texts]
        calls = [[call.to_openai() for call in choice_calls] for _, choice_calls in parsed]
        state.metrics.tool_calls.inc(sum(map(len, calls)))
        texts = [content if choice_calls else text for text, (content, choice_calls) in zip(texts, parsed)]
        reasons = [tools.finish_reason(reason, bool(choice_calls)) for reason, choice_calls in zip(reasons, calls)]
    id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    return completion_body(kind, id, service.name, list(zip(texts, reasons)), usage, bodies, calls)


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
    tools: ToolUse | None = None,
    choices: int = 1,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer. When the client disconnects, Starlette cancels this generator at
    an await, and `finally` cancels the sequences. A token's log probabilities go out with the chunk that carries its
    text (a token whose text is held back, an incomplete character or a possible stop string, waits for it). With
    `tools`, each choice's text goes through its tool-call stream, whose deltas (content, or a call's name and
    argument pieces) are the chunks."""
    id, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), int(time.time())
    tool_streams = [tools.format.stream() for _ in streams] if tools is not None else None
    called = [False] * len(streams)
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
                    if tool_streams is None:
                        yield sse(chunk_body(kind, id, created, model, index, delta, reason, logprobs=body))
                        continue
                    pieces = tool_streams[index].feed(delta) if delta else []
                    if reason is not None:
                        pieces += tool_streams[index].finish()
                    for piece in pieces:
                        if "tool_calls" in piece:
                            called[index] = True
                            if run.metrics is not None:
                                run.metrics.tool_calls.inc(sum("id" in call for call in piece["tool_calls"]))
                        yield sse(chunk_body(kind, id, created, model, index, None, logprobs=body, delta=piece))
                        body = None  # the log probabilities went with the first piece
                    if reason is not None:
                        reason = tools.finish_reason(reason, called[index])
                        yield sse(chunk_body(kind, id, created, model, index, None, reason, logprobs=body, delta={}))
        except OpenAIError as error:
            yield sse(error.body())
            return
        if include_usage:
            generated = sum(stream.generated for stream in streams)
            usage = usage_body(prompt_tokens, generated, run.cached_prompt_tokens(choices))
            yield sse(usage_chunk_body(kind, id, created, model, usage))
        yield "data: [DONE]\n\n"
    finally:
        run.cancel()


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
