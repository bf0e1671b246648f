"""What a served folder can do: generate (a causal LM, through the continuous-batching `Scheduler`), embed (an encoder's
feature-extraction export) or classify (a text-classification export), with its tokenizer.

    >>> service = load_service("exported/decoder")                       # ONNX Runtime, CPU
    >>> service = load_service("vaswani-folder", backend="torch")       # PyTorch
    >>> service.scheduler.start()
"""

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..constraints import CompiledGrammar, Grammar, compile_grammar, grammar_vocabulary
from ..runtime.decoders.paged import check_kv_cache_dtype
from .batches import TorchStepModel, context_length
from .prefix_cache import DEFAULT_MAX_BYTES as DEFAULT_PREFIX_CACHE_BYTES
from .prefix_cache import PrefixCache
from .protocol import OpenAIError
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, Scheduler
from .speculation import check_draft, speculator_for
from .tools import TOOL_CALL_PARSERS, ToolCallFormat, tool_call_format

log = logging.getLogger(__name__)


class GenerationService:
    """A causal LM behind the engine: turns messages and prompts into token ids, checked against the model."""

    kind = "generation"
    tasks = ("text-generation",)  # the export tasks served this way

    def __init__(
        self,
        name: str,
        tokenizer: PreTrainedTokenizerBase,
        scheduler: Scheduler,
        eos_token_ids: set[int],
        tool_call_parser: str | None = None,
    ):
        self.name, self.tokenizer, self.scheduler = name, tokenizer, scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_length = scheduler.model.context_length
        self.vocab_size = scheduler.model.vocab_size
        self.description = scheduler.model.description  # what runs where (the decoder runtime's line)
        # How the model writes tool calls (`tool_format`): vLLM's --tool-call-parser name, None to read the template.
        self.tool_call_parser = tool_call_parser
        self._tool_format: ToolCallFormat | None = None

    def tool_format(self) -> ToolCallFormat:
        """How this model writes tool calls: `tool_call_parser` ("hermes", "llama3_json"; vLLM's names), or the
        format its chat template shows; a 400 when neither tells."""
        if self._tool_format is None:
            try:
                self._tool_format = tool_call_format(self.tool_call_parser, self.tokenizer.chat_template)
            except ValueError as error:
                raise OpenAIError(f"This server cannot parse this model's tool calls: {error}", param="tools") from None
        return self._tool_format

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise OpenAIError(
                f"The model {self.name!r} has no chat template in its tokenizer; use /v1/completions with a plain "
                "prompt, or set tokenizer.chat_template and save the tokenizer into the folder.",
                param="messages",
            )
        from jinja2 import TemplateError, TemplateSyntaxError  # what transformers renders chat templates with

        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, return_dict=True
            )
        except TemplateSyntaxError:
            raise  # the model's template is broken: the server's fault, a 500
        except TemplateError as error:
            # The template refused these messages (its `raise_exception`, e.g. roles that do not alternate): the
            # client's to fix, as vLLM answers it.
            raise OpenAIError(f"The model's chat template rejected the messages: {error}", param="messages") from None
        return list(encoded["input_ids"])

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` compiled for this model's vocabulary (the vocabulary is read once, the grammar cached), allowing
        this model's end-of-sequence ids where it is complete; a ValueError names what cannot be enforced."""
        vocabulary = grammar_vocabulary(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return compile_grammar(grammar, vocabulary)

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return list(prompt)

    def check(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """The number of new tokens allowed for `prompt`: `max_tokens`, or what is left of the context; a 400 when
        the prompt (and `max_tokens`) do not fit or hold ids outside the vocabulary."""
        outside = [token for token in prompt if not 0 <= token < self.vocab_size]
        if outside:
            raise OpenAIError(
                f"The prompt holds token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}."
            )
        room = self.context_length - len(prompt)
        if room < 1:
            raise OpenAIError(
                f"This model's maximum context length is {self.context_length} tokens, but the prompt has "
                f"{len(prompt)} tokens. Shorten the {param}.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                f"This model's maximum context length is {self.context_length} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the {param}, {max_tokens} in the completion). "
                f"Reduce the length of the {param} or max_tokens (at most {room} here).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens if max_tokens is not None else room

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def close(self) -> None:
        self.scheduler.stop()


class EncoderService:
    """An exported encoder: mean-pooled, L2-normalized embeddings (feature-extraction) or class probabilities
    (text-classification). Requests run the graph directly (no batching across requests): one call per request."""

    kinds = {"feature-extraction": "embedding", "text-classification": "classification"}  # export task -> kind
    description = ""
    scheduler = None  # no continuous batching: the app, its metrics and Ray replicas read this to know

    def __init__(self, name: str, tokenizer: PreTrainedTokenizerBase, model: Any, task: str):
        self.name, self.tokenizer, self.model = name, tokenizer, model
        self.kind = self.kinds[task]
        self.context_length = context_length(model.config)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and their mask; a 400 for a text longer than the context."""
        if not texts or any(not isinstance(text, str) or not text for text in texts):
            raise OpenAIError(
                "input must be a non-empty string or a non-empty list of non-empty strings.", param="input"
            )
        rows = [self.tokenizer(text)["input_ids"] for text in texts]
        longest = max(len(row) for row in rows)
        if longest > self.context_length:
            raise OpenAIError(
                f"An input has {longest} tokens; this model's maximum context length is {self.context_length}.",
                param="input",
                code="context_length_exceeded",
            )
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        return ids, mask

    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        ids, mask = self.encode(texts)
        hidden = self.model(ids, attention_mask=mask).last_hidden_state.float()
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist(), int(mask.sum())

    def classify(self, texts: list[str]) -> tuple[list[dict[str, Any]], int]:
        ids, mask = self.encode(texts)
        probabilities = self.model(ids, attention_mask=mask).logits.float().softmax(-1)
        labels = self.model.config.id2label
        results = []
        for row in probabilities.tolist():
            best = int(np.argmax(row))
            scores = {labels.get(i, str(i)): score for i, score in enumerate(row)}
            results.append({"label": labels.get(best, str(best)), "score": row[best], "scores": scores})
        return results, int(mask.sum())

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def load_service(
    folder: str | os.PathLike,
    backend: str = "onnx",
    provider: str = "cpu",
    threads: int | None = None,
    name: str | None = None,
    max_batch: int = 16,
    max_waiting: int = 64,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
    engine: str = "onnxruntime",
    openvino_precision: str = "auto",
    tool_call_parser: str | None = None,
    speculative_config: str | dict | None = None,
    kv_cache_dtype: str = "auto",
    openvino_int8_activations: bool = True,
) -> GenerationService | EncoderService:
    """Load `folder` for serving: an exported ONNX folder (`backend="onnx"`, on `provider` "cpu" or "cuda") or a
    PyTorch vaswani folder (`backend="torch"`), local or a Hub repository id; `threads` ONNX Runtime's intra-op threads
    (default: every available core; the torch backend runs on torch's threads as the process set them); `name` the
    model id clients send (default: the folder's name); `engine` the runtime of an export (`OrtModel.from_pretrained`:
    "openvino" runs a text-generation export's prompt steps, and decode steps where faster, in OpenVINO in
    `openvino_precision`). A text-generation export is served by its decoder runtime's step model and batch kind
    (`model.decoder_runtime.step_model()`); `tool_call_parser` names the format its tool calls are parsed in
    ("hermes", "llama3_json"; default: the one its chat template shows). The scheduler computes at most
    `max_num_batched_tokens` tokens per iteration (decode tokens and a prompt chunk) and keeps prompt prefixes' keys
    and values in a prefix cache of `prefix_cache_bytes` (0: none); `speculative_config` turns on speculative
    decoding (vLLM's `--speculative-config` JSON or a dict, `speculation.SpeculativeConfig`: prompt lookup or a draft
    model; default off). `kv_cache_dtype` is the paged cache's under `engine="openvino"` ("auto": float16 at f32
    compute, bfloat16 at bf16; "float32" or "float16" at f32, "bfloat16" at bf16); `openvino_int8_activations=False`
    gives its products of int8/int4 weights float activations in every call, so that a sequence's tokens do not
    depend on the rows it shares steps with and greedy speculation keeps plain decoding's tokens at f32 compute
    (prompts compute slower). The scheduler is not started."""
    check_kv_cache_dtype(kv_cache_dtype)  # before the model loads
    openvino_options = paged_options(kv_cache_dtype, openvino_int8_activations)
    if backend != "onnx" or engine not in ("openvino", "auto"):  # "auto" is known once the model is loaded
        refuse_openvino_options(openvino_options, "PyTorch" if backend == "torch" else "ONNX Runtime")
    speculator = speculator_for(speculative_config, provider, threads)
    if tool_call_parser not in (None, "auto", *TOOL_CALL_PARSERS):
        choices = ", ".join(["auto", *TOOL_CALL_PARSERS])
        raise ValueError(f"Unknown tool call parser {tool_call_parser!r}; use one of {choices}.")
    if name is None:  # a local folder's name as given (a symlink's own, "."'s directory); a Hub id as it is
        name = Path(os.path.abspath(folder)).name if Path(folder).exists() else str(folder)
    folder = resolve_folder(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model folder (no config.json); pass an exported or saved vaswani folder.")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if backend == "onnx":
        if not (folder / "manifest.json").is_file():
            raise ValueError(
                f"{folder} has no manifest.json: it is not an ONNX export. For a PyTorch folder pass --backend torch."
            )
        from ..runtime import class_for_task

        task = json.loads((folder / "manifest.json").read_text())["task"]
        served = (*GenerationService.tasks, *EncoderService.kinds)
        if task not in served:
            raise ValueError(
                f"{folder} holds a {task!r} export; vaswani serve serves text-generation (chat and completions), "
                f"feature-extraction (embeddings) and text-classification exports."
            )
        # The engine (and, for a causal LM, its decoder runtime) is the model's to choose and to refuse with the fix.
        options = dict(session_options=session_options(threads), engine=engine, openvino_precision=openvino_precision)
        model = class_for_task(task).from_pretrained(folder, provider, **options)
        if task in EncoderService.kinds:
            return EncoderService(name, tokenizer, model, task)
        step_model = serving_step_model(model, openvino_options)
        check_draft(speculator, step_model.vocab_size)
        scheduler = Scheduler(
            step_model,
            max_batch,
            max_waiting,
            max_num_batched_tokens,
            prefix_cache(prefix_cache_bytes, step_model),
            speculator=speculator,
        )
        return GenerationService(
            name, tokenizer, scheduler, eos_ids(model.generation_config, tokenizer), tool_call_parser
        )
    if engine == "openvino":
        raise ValueError(f"engine={engine!r} runs ONNX exports; it cannot serve with backend={backend!r}.")
    if backend == "torch":
        from ..modeling import VaswaniForCausalLM

        model = VaswaniForCausalLM.from_pretrained(folder)
        if provider == "cuda":
            model = model.to("cuda")
        check_draft(speculator, model.config.vocab_size)
        step_model = TorchStepModel(model)
        cache = prefix_cache(prefix_cache_bytes, step_model)
        scheduler = Scheduler(step_model, max_batch, max_waiting, max_num_batched_tokens, cache, speculator=speculator)
        return GenerationService(
            name, tokenizer, scheduler, eos_ids(model.generation_config, tokenizer), tool_call_parser
        )
    raise ValueError(f"backend must be 'onnx' or 'torch', got {backend!r}.")


def paged_options(kv_cache_dtype: str, int8_activations: bool) -> dict[str, Any]:
    """The options of OpenVINO's paged batch that differ from its defaults, as its `step_model` takes them."""
    options: dict[str, Any] = {}
    if kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = kv_cache_dtype
    if not int8_activations:
        options["int8_activations"] = False
    return options


def serving_step_model(model: Any, openvino_options: dict[str, Any]) -> Any:
    """The decoder runtime's step model; `openvino_options` (`paged_options`) only where it is OpenVINO's."""
    if not openvino_options:
        return model.decoder_runtime.step_model()
    if model.decoder_runtime.engine != "openvino":
        refuse_openvino_options(openvino_options, "ONNX Runtime")
    return model.decoder_runtime.step_model(**openvino_options)


# Each option of OpenVINO's paged batch (as its `step_model` names it): `load_service`'s name for it, its flag, and
# what the other runtimes do instead.
OPENVINO_OPTIONS = {
    "kv_cache_dtype": ("kv_cache_dtype", "--kv-cache-dtype", "keeps its cache in the model's precision"),
    "int8_activations": (
        "openvino_int8_activations", "--openvino-int8-activations", "computes its products as the export's graph says"
    ),
}


def refuse_openvino_options(options: dict[str, Any], runtime: str) -> None:
    """A ValueError naming the first of `options` set where the step model is not OpenVINO's paged batch."""
    for name, value in options.items():
        parameter, flag, instead = OPENVINO_OPTIONS[name]
        raise ValueError(
            f"{parameter}={value!r} ({flag}) sets the paged batch of engine='openvino' (--engine openvino); "
            f"{runtime} {instead}. Leave it at its default here."
        )


def prefix_cache(max_bytes: int, step_model: Any) -> PrefixCache | None:
    """The server's prefix cache of `max_bytes` for `step_model`'s batches (None for 0: caching off), logged either
    way."""
    if max_bytes < 0:
        raise ValueError(f"The prefix cache's size must be 0 (off) or more bytes, not {max_bytes}.")
    if max_bytes == 0:
        log.info("prefix caching is off (--prefix-cache-bytes 0)")
        return None
    log.info("prefix caching keeps up to %.0f MiB of prompt prefixes' keys and values", max_bytes / (1 << 20))
    return PrefixCache.for_model(step_model, max_bytes)


def resolve_folder(folder: str | os.PathLike) -> Path:
    """A local folder as it is; a Hugging Face Hub repository id ("owner/name", not a local path) downloaded into the
    Hub cache (each Ray replica on another machine does this itself)."""
    path = Path(folder)
    text = str(folder)
    if path.exists() or text.count("/") != 1 or text.startswith((".", "/", "~")):
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(text))


def session_options(threads: int | None):
    from ..runtime import default_session_options

    return default_session_options(threads)


def eos_ids(generation_config: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids that end an answer: the generation config's end-of-sequence ids, else the tokenizer's."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    ids = {token for token in ids if token is not None}
    if not ids and tokenizer.eos_token_id is not None:
        ids = {tokenizer.eos_token_id}
    return ids
