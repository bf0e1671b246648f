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

import base64
import os
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .completions import answer, tool_use
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
from .services import EncoderService, GenerationService
from .tools import template_messages

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
        tools = tool_use(generation, body)
        messages = template_messages([message.template_input() for message in body.messages])
        offered = tools.tools if tools is not None else None
        prompt = await run_in_threadpool(generation.chat_prompt, messages, offered)
        return await answer(request, generation, "chat", body, [prompt], "messages", tools)

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
