"""A minimal OpenAI-compatible HTTP shim of ours over OpenVINO GenAI's continuous-batching pipeline, so that
benchmarks/benchmark_serve_mixed.py can send it the same streamed requests as the other servers. It is not part of
OpenVINO GenAI (whose own server is OpenVINO Model Server); it runs in the OpenVINO venv of
benchmarks/serve_engines/setup.sh.

    python openvino_server.py OV_FOLDER --port 8001 --threads 2 --max-num-seqs 16 [--model-name NAME]
        [--no-prefix-caching]

The engine is `openvino_genai.ContinuousBatchingPipeline` with a `SchedulerConfig` (the pipeline that `LLMPipeline`
runs when it is given a `scheduler_config`), driven the way a server drives it: one thread adds the requests that
arrived (`add_request`) and calls `step()` while any is unfinished; after each step every request's new tokens
(`GenerationHandle.read()`) go to its HTTP stream. The scheduler's prefix caching (`enable_prefix_caching`: KV blocks of
earlier prompts reused by a prompt that starts the same way) is set explicitly, on unless `--no-prefix-caching`, and
`/health` reports it with the precision the CPU plugin computes in (`INFERENCE_PRECISION_HINT`). Routes: GET /health, GET /v1/models, POST /v1/completions (a text
`prompt`, `max_tokens`, `ignore_eos`, `temperature` 0 (greedy) or above (multinomial sampling), `stream`,
`stream_options.include_usage`). Text is detokenized with the folder's transformers tokenizer, decoding the answer so
far and sending what is new (answers are short here).
"""

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid

import openvino_genai
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoTokenizer


class Engine:
    """The pipeline and the thread that steps it; `submit` returns an asyncio queue of lists of new token ids,
    closed by None."""

    def __init__(
        self, folder: str, threads: int, max_num_seqs: int, cache_gb: int, max_batched_tokens: int, prefix_caching: bool
    ):
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.max_num_seqs = max_num_seqs
        scheduler.cache_size = cache_gb
        scheduler.max_num_batched_tokens = max_batched_tokens
        scheduler.dynamic_split_fuse = True  # prompts chunked among decoding steps, as vLLM's chunked prefill
        # Set either way rather than left to the release's default, which has changed between releases.
        scheduler.enable_prefix_caching = prefix_caching
        self.settings = {"enable_prefix_caching": scheduler.enable_prefix_caching, "max_num_seqs": max_num_seqs,
                         "max_num_batched_tokens": max_batched_tokens, "cache_size_gb": cache_gb,
                         "dynamic_split_fuse": True, "inference_precision": inference_precision(),
                         "kv_cache_precision": cpu_default("KV_CACHE_PRECISION"),
                         "dynamic_quantization_group_size": cpu_default("DYNAMIC_QUANTIZATION_GROUP_SIZE")}  # fmt: skip
        properties = {"INFERENCE_NUM_THREADS": threads}
        self.pipeline = openvino_genai.ContinuousBatchingPipeline(folder, scheduler, "CPU", properties)
        self.arrived: queue.Queue = queue.Queue()
        self.wakeup = threading.Event()
        self.next_id = 0
        threading.Thread(target=self.run, daemon=True).start()

    def submit(self, prompt: str, config: openvino_genai.GenerationConfig) -> asyncio.Queue:
        loop, tokens = asyncio.get_running_loop(), asyncio.Queue()
        self.arrived.put((prompt, config, loop, tokens))
        self.wakeup.set()
        return tokens

    def run(self) -> None:
        active = []  # (handle, loop, queue)
        while True:
            if not active:
                self.wakeup.wait()
            self.wakeup.clear()
            while not self.arrived.empty():
                prompt, config, loop, tokens = self.arrived.get()
                self.next_id += 1
                active.append((self.pipeline.add_request(self.next_id, prompt, config), loop, tokens))
            if not active:
                continue
            self.pipeline.step()
            still = []
            for handle, loop, tokens in active:
                if handle.can_read():
                    new = [token for output in handle.read().values() for token in output.generated_ids]
                    if new:
                        loop.call_soon_threadsafe(tokens.put_nowait, new)
                if handle.get_status() == openvino_genai.GenerationStatus.RUNNING:
                    still.append((handle, loop, tokens))
                else:
                    loop.call_soon_threadsafe(tokens.put_nowait, None)
            active = still
            # Let the event loop send what this step made before the next step takes the GIL back: without it the
            # chunks of several steps went out together (inter-token gaps of 0 ms, then one long one).
            time.sleep(0)


def cpu_default(name: str) -> str:
    """A CPU plugin property's default on this CPU, as text (the pipeline is given no value for it)."""
    import openvino

    value = openvino.Core().get_property("CPU", name)
    return value.to_string() if hasattr(value, "to_string") else str(value)


def inference_precision() -> str:
    """The precision OpenVINO's CPU plugin computes in by default on this CPU (bf16 where it has AMX or AVX512_BF16)."""
    import openvino

    return openvino.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()


def create_app(engine: Engine, tokenizer, name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": name, "scheduler": engine.settings}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "openvino-genai"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = int(body.get("max_tokens", 16))
        config.ignore_eos = bool(body.get("ignore_eos", False))
        temperature = float(body.get("temperature", 1.0))
        if temperature > 0:
            config.do_sample, config.temperature = True, temperature
        prompt = body["prompt"]
        prompt_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        tokens = engine.submit(prompt, config)
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None = None, usage: dict | None = None) -> str:
            choices = [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]
            event = {"id": completion_id, "object": "text_completion", "created": created, "model": name}
            event.update(choices=choices, usage=usage)
            return f"data: {json.dumps(event)}\n\n"

        async def answer():
            generated, sent = [], ""
            while (new := await tokens.get()) is not None:
                generated += new
                text = tokenizer.decode(generated, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # a character cut in the middle: wait for its next token
                    continue
                yield text[len(sent) :]
                sent = text
            finish = "length" if len(generated) >= config.max_new_tokens else "stop"
            yield finish, len(generated)

        if body.get("stream"):

            async def events():
                async for piece in answer():
                    if isinstance(piece, tuple):
                        finish, count = piece
                        yield chunk("", finish)
                        if (body.get("stream_options") or {}).get("include_usage"):
                            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count}
                            yield chunk("", usage={**usage, "total_tokens": prompt_tokens + count})
                    elif piece:
                        yield chunk(piece)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text, finish, count = "", "stop", 0
        async for piece in answer():
            if isinstance(piece, tuple):
                finish, count = piece
            else:
                text += piece
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count, "total_tokens": prompt_tokens + count}
        return JSONResponse(
            {
                "id": completion_id,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": usage,
            }
        )

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--cache-gb", type=int, default=1, help="KV cache size in GB")
    parser.add_argument("--model-name")
    parser.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", help="SchedulerConfig.enable_prefix_caching"
    )
    args = parser.parse_args()
    engine = Engine(
        args.folder, args.threads, args.max_num_seqs, args.cache_gb, args.max_num_batched_tokens, args.prefix_caching
    )
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    name = args.model_name or args.folder.rstrip("/").split("/")[-1]
    uvicorn.run(create_app(engine, tokenizer, name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
