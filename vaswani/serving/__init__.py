"""`vaswani serve`: an OpenAI-compatible HTTP server with continuous batching (`pip install 'vaswani[serve]'`).

Where things are:

- `protocol.py`: the OpenAI request shapes, the checks on requests and the errors; `responses.py`: the response bodies.
- `batches.py`: the interface the scheduler drives (`Batch`, `Prefill`) and PyTorch's step model (`TorchStepModel`);
  an export's step model and batch kind come from its decoder runtime (`model.decoder_runtime.step_model()`,
  `vaswani.runtime.decoders`: left-padded, per-row lengths in in-place KV buffers, or held by OpenVINO).
- `scheduler.py`: the scheduler thread: admission, chunked prefill, one decoding step for every running sequence,
  the queue limit, the watchdog's liveness.
- `sampling.py`: each row's token: transformers' own logits processors and a seeded draw, as offline `generate`.
- `text.py`: incremental detokenization and stop strings for streams.
- `services.py`: loading a folder into a service (generation, embeddings, classification).
- `app.py`: the FastAPI routes and server-sent events.
- `middleware.py`: request ids and the access log, the API key check; `metrics.py`: `/metrics` (Prometheus).
- `ray_app.py`: the same app as a Ray Serve deployment with N replicas.

Example:
    >>> import uvicorn
    >>> from vaswani.serving import create_app, load_service
    >>> uvicorn.run(create_app(load_service("exported/decoder")), port=8000)  # doctest: +SKIP
"""

from .app import create_app
from .scheduler import QueueFull, SamplingParams, Scheduler
from .services import EncoderService, GenerationService, load_service

__all__ = [
    "Scheduler",
    "EncoderService",
    "GenerationService",
    "QueueFull",
    "SamplingParams",
    "create_app",
    "load_service",
]
