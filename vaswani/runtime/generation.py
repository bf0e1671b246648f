"""The generating ONNX Runtime models, `OrtModelForCausalLM` and `OrtModelForSeq2SeqLM`, with transformers' `generate()`.

Generation is transformers' own `GenerationMixin.generate` (every strategy, logits processor and stopping criterion):
`forward` returns the cache as a transformers `DynamicCache`/`EncoderDecoderCache` whose tensors share memory with
ONNX Runtime's outputs. Greedy search and sampling, the common case, run in a lean loop (`lean_sample`, generate's
`custom_generate`) that feeds the cache tensors straight back to the graph and skips generate's per-step bookkeeping;
it uses the same logits processors, stopping criteria and random draws, so its tokens are identical.

On CUDA, inputs and outputs are bound to device memory (IO binding): the cache is written into preallocated device
buffers (`KVBuffers`) and never leaves the GPU. On CPU, tensors pass to `session.run` as numpy arrays sharing their
memory.

    >>> model = OrtModelForCausalLM.from_pretrained("exported/decoder")
    >>> model.generate(input_ids, do_sample=True, top_p=0.9, max_new_tokens=32)     # sampling
    >>> model.generate(input_ids, num_beams=4, max_new_tokens=32)                   # beam search
"""

import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast, Seq2SeqLMOutput

from ..modeling import cache_keyword, cache_of
from ..modeling.pretrained import merge_cache_arguments, takes_the_cache_under_its_old_name
from .contract import positions_from_mask
from .decoders import DecoderRuntime, LoadRequest, choose_decoder_runtime
from .lean_steps import Step, lean_loop_fits, sample_tokens
from .models import OrtModel, check_unsupported_arguments
from .session import TENSOR_DTYPES, DecodingGraph, OrtGraph, checked_mask, logits_positions
from .speculative import prompt_lookup_fits, prompt_lookup_sample


class KVBuffers:
    """Preallocated device memory for the cache tensors of IO-bound decoding: two buffers per cache tensor.

    Each step reads the past keys/values from one buffer and writes the present ones (past + new) into the other,
    so no cache tensor is allocated between steps and none leaves the device.
    """

    def __init__(
        self, count: int, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device
    ):
        self.batch, self.heads, self.head_dim, self.capacity = batch, heads, head_dim, capacity
        size = batch * heads * capacity * head_dim
        self.buffers = [torch.empty(count, size, dtype=dtype, device=device) for _ in range(2)]

    def fits(self, batch: int, length: int) -> bool:
        return batch == self.batch and length <= self.capacity

    def present_views(self, past: torch.Tensor, length: int) -> list[torch.Tensor]:
        """(batch, heads, length, head_dim) views into the buffer that does not hold `past`."""
        holds_past = past.numel() and past.untyped_storage().data_ptr() == self.buffers[0].untyped_storage().data_ptr()
        target = self.buffers[1 if holds_past else 0]
        numel = self.batch * self.heads * length * self.head_dim
        return [row[:numel].view(self.batch, self.heads, length, self.head_dim) for row in target]


def cache_tensors(cache: DynamicCache | None) -> list[torch.Tensor] | None:
    """[key 0, value 0, key 1, ...] of a filled cache, else None."""
    if cache is None or not cache.layers or cache.get_seq_length() == 0:
        return None
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]


def store_in_cache(cache: DynamicCache, tensors: list[torch.Tensor]) -> None:
    """Make `cache` hold `tensors` ([key 0, value 0, ...]) as they are: no concatenation, no copy."""
    while len(cache.layers) < len(tensors) // 2:
        cache.layers.append(DynamicLayer())
    for layer, key, value in zip(cache.layers, tensors[::2], tensors[1::2]):
        layer.keys, layer.values = key, value
        layer.dtype, layer.device, layer.is_initialized = key.dtype, key.device, True


class OrtModelForGeneration(OrtModel, GenerationMixin):
    """What the two generating classes share: the cache inputs and outputs of the decoding graph, the interface
    transformers' `GenerationMixin` needs from a model, and the lean greedy/sampling loop (`lean_sample`).

    Set `fast_generation = False` on an instance to make greedy search and sampling run through transformers'
    own loop too (slower, same tokens).
    """

    decoding_graph: ClassVar[str]
    fast_generation: bool = True
    # What GenerationMixin reads from a PreTrainedModel: no recurrent state (transformers before 5.25 read
    # `_is_stateful` to refuse assisted generation; 5.25 asks the cache instead), and the name under which an
    # encoder-decoder would keep its base model (there is none here). Drop `_is_stateful` once the floor is 5.25.
    _is_stateful = False
    base_model_prefix = "model"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (self.folder / "generation_config.json").is_file():
            self.generation_config = GenerationConfig.from_pretrained(self.folder)
        else:
            self.generation_config = GenerationConfig.from_model_config(self.config)
        graph = self.graphs[self.decoding_graph]
        layers = self.manifest["num_layers"]
        self.past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.cache_dtype = TENSOR_DTYPES[graph.inputs[self.past_names[0]]["dtype"]][1]
        self.decoding = DecodingGraph(graph, self.past_names, self.present_names)
        self.kv_buffers: weakref.WeakKeyDictionary[Cache, KVBuffers] = weakref.WeakKeyDictionary()

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *args, **kwargs
    ) -> Any:
        """transformers' `GenerationMixin.generate`, with the same tokens and two speed-ups.

        Greedy search and sampling that `lean_loop_fits` run in the lean loop: transformers prepares the inputs,
        processors and stopping criteria, then calls `lean_sample` (its public `custom_generate` hook) to decode.
        Arguments passed by position after `generation_config` keep transformers' loop.

        torch's intra-op thread count is the caller's (`torch.set_num_threads` is process state: a library that set
        it around each call would change it under every other thread). On a few shared CPU cores, set it to 1 once
        at startup: each step's torch work (processors, sampling over the vocabulary) is on vectors, and torch's
        OpenMP threads compete for the cores with ONNX Runtime's intra-op threads, still spinning from the step's
        run (on 2 cores, a sampled token of a 49k vocabulary takes several times longer with 2 torch threads).
        """
        if not args and self.fast_generation and lean_loop_fits(self.generation_config, generation_config, kwargs):
            kwargs["custom_generate"] = type(self).lean_sample  # called as a method: (model, input_ids, ...)
        return super().generate(inputs, generation_config, *args, **kwargs)

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def is_remote_code(self) -> bool:
        return False

    def get_experts_implementation(self) -> dict[str, str | None]:
        return {"": None}  # no mixture of experts (GenerationMixin asks)

    def empty_past(self, batch: int) -> list[torch.Tensor]:
        shape = (batch, self.manifest["num_key_value_heads"], 0, self.manifest["head_dim"])
        return [torch.empty(shape, dtype=self.cache_dtype, device=self.device)] * len(self.past_names)

    def new_kv_buffers(self, batch: int, capacity: int) -> KVBuffers:
        heads, head_dim = self.manifest["num_key_value_heads"], self.manifest["head_dim"]
        return KVBuffers(len(self.past_names), batch, heads, head_dim, capacity, self.cache_dtype, self.device)

    def kv_buffers_for(self, cache: Cache, batch: int, length: int) -> KVBuffers | None:
        """With IO binding, the buffers `cache`'s tensors are written into, grown (doubled) when `length` no longer
        fits; None without (ONNX Runtime then allocates each step's cache tensors)."""
        if not self.graphs[self.decoding_graph].use_io_binding:
            return None
        buffers = self.kv_buffers.get(cache)
        if buffers is None or not buffers.fits(batch, length):
            buffers = self.kv_buffers[cache] = self.new_kv_buffers(batch, max(2 * length, 64))
        return buffers

    @property
    def graph_runner(self) -> Any:
        """What runs the decoding graph's calls with the cache tensors (`run`, `run_arrays`): the graph itself here; a
        causal LM's decoder runtime."""
        return self.decoding

    def run_decoding_graph(
        self, inputs: dict[str, torch.Tensor], past: list[torch.Tensor], buffers: KVBuffers | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One call of the decoding graph: logits (batch, sequence, vocab) and the present cache tensors."""
        return self.graph_runner.run(inputs, past, buffers)

    def run_step_arrays(
        self, inputs: dict[str, torch.Tensor], past: list[np.ndarray]
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """`run_decoding_graph` for the lean loop on the CPU without IO binding, with the cache as numpy arrays in and
        out (`session.DecodingGraph.run_arrays`). `inputs` are the prepared, contiguous CPU tensors."""
        return self.graph_runner.run_arrays(inputs, past)

    # -- the lean loop

    def lean_sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        **model_kwargs,
    ) -> torch.LongTensor:
        """`generate`'s decoding loop for the calls that `lean_loop_fits` (passed as its `custom_generate`):
        transformers' greedy/sampling loop (`sample_tokens`) over the lean step (`graph_step`), which skips
        transformers' per-step bookkeeping (Cache objects, input preparation, output dataclasses: about as much as
        a decode step of a small model on CPU), or over `forward_step` for the inputs that only `forward` takes."""
        step = self.graph_step(input_ids, model_kwargs, generation_config.max_length)
        step = step or self.forward_step(input_ids, model_kwargs)
        return sample_tokens(step, input_ids, logits_processor, stopping_criteria, generation_config)

    def graph_step(self, input_ids: torch.Tensor, model_kwargs: dict, max_length: int) -> Step | None:
        """The lean loop's step: the decoding graph run on the cache tensors of the previous run, as they are; None
        when `model_kwargs` ask for more than it does (`fast_loop_inputs`)."""
        start = self.fast_loop_inputs(input_ids, model_kwargs)
        if start is None:
            return None
        inputs, first_tokens = start
        batch = input_ids.shape[0]
        use_io_binding = self.graphs[self.decoding_graph].use_io_binding
        buffers = self.new_kv_buffers(batch, max_length) if use_io_binding else None
        # Without IO binding the cache stays in ONNX Runtime's numpy arrays from step to step (`run_step_arrays`).
        past = self.empty_past(batch) if use_io_binding else [tensor.numpy() for tensor in self.empty_past(batch)]

        def step(tokens: torch.Tensor | None) -> torch.Tensor:
            nonlocal past
            if tokens is None:
                tokens = first_tokens
            else:
                tokens = tokens[:, None].to(self.device)
                self.advance_inputs(inputs)
            if use_io_binding:
                logits, past = self.run_decoding_graph({**inputs, "input_ids": tokens}, past, buffers)
            else:
                logits, past = self.run_step_arrays({**inputs, "input_ids": tokens}, past)
            return logits[:, -1]

        return step

    def forward_step(self, input_ids: torch.Tensor, model_kwargs: dict) -> Step:
        """A step through `forward` and its cache, fed as transformers' own loop feeds it: for the inputs that the
        lean step leaves to `forward` (which computes them, or refuses them with its reason)."""
        arguments, cache = self.forward_arguments(input_ids, model_kwargs), None

        def step(tokens: torch.Tensor | None) -> torch.Tensor:
            nonlocal arguments, cache
            if tokens is not None:
                arguments = self.next_forward_arguments(arguments, tokens[:, None].to(self.device))
            outputs = self.forward(**arguments, cache=cache, use_cache=True)
            cache = cache_of(outputs)
            return outputs.logits[:, -1]

        return step

    def fast_loop_inputs(
        self, input_ids: torch.Tensor, model_kwargs: dict
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """The decoding graph's inputs besides `input_ids` and the cache, checked, and the first tokens to feed; or
        None when the lean loop cannot honour `model_kwargs`."""
        raise NotImplementedError

    def advance_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        """Update the non-cache inputs for the next single-token step."""

    def forward_arguments(self, input_ids: torch.Tensor, model_kwargs: dict) -> dict[str, Any]:
        """`forward_step`'s arguments of `forward` (all but the cache) for the prompt, from generate's."""
        raise NotImplementedError

    def next_forward_arguments(self, arguments: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
        """`arguments` for the next step, which feeds each row's new token (`tokens`: (batch, 1))."""
        raise NotImplementedError


class OrtModelForCausalLM(OrtModelForGeneration):
    """An exported `VaswaniForCausalLM` (task "text-generation") with transformers' `generate()`.

    What runs the graph is `decoder_runtime` (`vaswani.runtime.decoders`), chosen once by `from_pretrained` from the
    `engine` asked for and the export's form: `forward`, the lean loop and the server's batch all go through it.

    Example:
        >>> from transformers import AutoTokenizer
        >>> model = OrtModelForCausalLM.from_pretrained("exported")
        >>> tokenizer = AutoTokenizer.from_pretrained("exported")
        >>> inputs = tokenizer(["Once upon a time"], return_tensors="pt")
        >>> tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0])
    """

    tasks = ("text-generation",)
    decoding_graph = "model"
    # How this export runs (`decoders.DecoderRuntime`: portable, gqa, openvino, ...), chosen once by `from_pretrained`.
    decoder_runtime: DecoderRuntime

    @classmethod
    def runtime_for(cls, engine: str, request: LoadRequest) -> type[DecoderRuntime]:
        return choose_decoder_runtime(engine, request)

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, *args, **kwargs
    ) -> Any:
        """`OrtModelForGeneration.generate`; prompt-lookup speculation (`prompt_lookup_num_tokens`) on one prompt runs
        in a lean loop of its own (`speculative.prompt_lookup_sample`), with the same tokens as transformers' assisted
        generation for greedy search and the same distribution for sampling."""
        if (
            not args
            and self.fast_generation
            and prompt_lookup_fits(self.generation_config, generation_config, inputs, kwargs)
        ):
            kwargs["custom_generate"] = prompt_lookup_sample
        return super().generate(inputs, generation_config, *args, **kwargs)

    @property
    def graph_runner(self) -> DecoderRuntime:
        return self.decoder_runtime

    @property
    def provider(self) -> str:
        return self.decoder_runtime.provider

    @takes_the_cache_under_its_old_name
    def forward(
        self,
        input_ids: torch.Tensor | np.ndarray,
        attention_mask: torch.Tensor | np.ndarray | None = None,
        position_ids: torch.Tensor | np.ndarray | None = None,
        cache: Cache | None = None,
        use_cache: bool = True,
        return_dict: bool = True,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Args as `VaswaniForCausalLM.forward`: `input_ids` (batch, sequence); `attention_mask` (batch, cached +
        new tokens), all ones by default; `position_ids` (batch, sequence), from the mask by default; `cache` (or
        `past_key_values`, its name before transformers 5.24) a `DynamicCache` of earlier calls (updated in place, as
        in PyTorch); `logits_to_keep` the positions whose logits are computed (0: all, n: the last n, or a 1-D tensor
        of positions; `generate` passes 1). Returns those logits and, with `use_cache`, the cache."""
        check_unsupported_arguments(kwargs)
        cache = merge_cache_arguments(cache, past_key_values)
        if cache is not None and not isinstance(cache, DynamicCache):
            raise TypeError(
                f"cache must be a transformers DynamicCache (from an earlier call), got {type(cache).__name__}."
            )
        input_ids = self.graphs["model"].convert("input_ids", input_ids)
        past = cache_tensors(cache) or self.empty_past(input_ids.shape[0])
        if cache is None and use_cache:
            cache = DynamicCache()
        arguments = (input_ids, attention_mask, position_ids, past, logits_to_keep, cache if use_cache else None)
        logits, present = self.decoder_runtime.forward(*arguments)
        if use_cache:
            store_in_cache(cache, present)
        output = CausalLMOutputWithPast(logits=logits, **cache_keyword(cache if use_cache else None))
        return output if return_dict else output.to_tuple()

    def decoder_inputs(
        self,
        input_ids: Any,
        attention_mask: Any,
        position_ids: Any,
        past: list[torch.Tensor],
        logits_to_keep: int | torch.Tensor = 0,
    ) -> dict[str, torch.Tensor]:
        """The checked graph inputs, with the defaults: no padding, positions counted from the mask, and every
        position's logits."""
        graph = self.graphs["model"]
        input_ids = graph.convert("input_ids", input_ids)
        (batch, length), total = input_ids.shape, past[0].shape[2] + input_ids.shape[1]
        attention_mask = graph.convert("attention_mask", checked_mask(attention_mask, batch, total, self.device))
        values = {"input_ids": input_ids, "attention_mask": attention_mask, **dict(zip(self.past_names, past))}
        if "position_ids" in graph.inputs:
            if position_ids is None:
                position_ids = positions_from_mask(attention_mask)[:, -length:]  # as transformers' generate
            values["position_ids"] = position_ids
        values["logits_positions"] = logits_positions(logits_to_keep, length)
        return graph.prepare(values)

    def lean_sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        """As `OrtModelForGeneration.lean_sample`, where the decoder runtime has no loop of its own for the call
        (`DecoderRuntime.sample`: the GroupQueryAttention form's, and OpenVINO's where it runs every step, hold the
        cache for the whole call); `forward_step` for the prompts neither can start from."""
        loop = (logits_processor, stopping_criteria, generation_config)
        mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
        tokens = self.decoder_runtime.sample(input_ids, mask, positions, *loop)
        if tokens is not None:
            return tokens
        return super().lean_sample(input_ids, *loop, **model_kwargs)

    def fast_loop_inputs(self, input_ids: torch.Tensor, model_kwargs: dict):
        if not self.decoder_runtime.takes_cache_tensors:
            return None  # its own loop (`sample`) declined these inputs: `forward` takes them, or says why it cannot
        past = self.empty_past(input_ids.shape[0])
        inputs = self.decoder_inputs(
            input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"), past, logits_to_keep=1
        )
        for name in self.past_names:
            del inputs[name]
        return inputs, inputs.pop("input_ids")

    def advance_inputs(self, inputs: dict[str, torch.Tensor]) -> None:
        inputs["attention_mask"] = with_new_column(inputs["attention_mask"])
        if "position_ids" in inputs:
            inputs["position_ids"] = inputs["position_ids"][:, -1:] + 1
        inputs["logits_positions"] = inputs["logits_positions"].new_zeros(1)  # the one new token

    def forward_arguments(self, input_ids: torch.Tensor, model_kwargs: dict) -> dict[str, Any]:
        names = ("attention_mask", "position_ids")
        return {"input_ids": input_ids, **{name: model_kwargs.get(name) for name in names}, "logits_to_keep": 1}

    def next_forward_arguments(self, arguments: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
        positions = arguments["position_ids"]
        positions = None if positions is None else positions[:, -1:] + 1
        mask = with_new_column(arguments["attention_mask"])
        return {**arguments, "input_ids": tokens, "attention_mask": mask, "position_ids": positions}


def with_new_column(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A padding mask (batch, tokens) extended by one attended token per row; None (no padding) stays None."""
    return None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)


@dataclass
class OrtEncoderOutput(BaseModelOutput):
    """The encoder graph's output: `last_hidden_state` and, per decoder layer, the cross-attention keys and values
    it projected from it (`cross_key_values`: key 0, value 0, key 1, ..., each (batch, heads, source, head_dim))."""

    cross_key_values: tuple[torch.Tensor, ...] | None = None


class OrtEncoder:
    """The encoder graph of an encoder-decoder export, as `get_encoder()` returns it to `generate()`."""

    main_input_name = "input_ids"

    def __init__(self, graph: OrtGraph, cross_names: list[str]):
        self.graph = graph
        self.cross_names = cross_names

    def forward(
        self, input_ids: Any, attention_mask: Any = None, return_dict: bool = True, **kwargs
    ) -> OrtEncoderOutput:
        """Encode `input_ids` (batch, source tokens) with their padding `attention_mask` (all ones by default)."""
        check_unsupported_arguments(kwargs)
        input_ids = self.graph.convert("input_ids", input_ids)
        attention_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        outputs = self.graph.run(self.graph.prepare({"input_ids": input_ids, "attention_mask": attention_mask}))
        return OrtEncoderOutput(
            last_hidden_state=outputs["last_hidden_state"],
            cross_key_values=tuple(outputs[name] for name in self.cross_names),
        )

    __call__ = forward


class OrtModelForSeq2SeqLM(OrtModelForGeneration):
    """An exported `VaswaniForConditionalGeneration` (task "text2text-generation") with transformers' `generate()`.

    The encoder graph runs once per input and also returns the decoder's cross-attention keys/values; they live in
    the cross-attention half of the `EncoderDecoderCache` (so beam search reorders them with the rest) and are fed
    to the decoder graph at every step.

    Example:
        >>> model = OrtModelForSeq2SeqLM.from_pretrained("exported")
        >>> model.generate(source_ids, attention_mask=source_mask, num_beams=4, max_new_tokens=32)
    """

    tasks = ("text2text-generation",)
    graph_names = ("encoder", "decoder")
    decoding_graph = "decoder"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers = self.manifest["num_layers"]
        self.cross_names = [f"cross_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.encoder = OrtEncoder(self.graphs["encoder"], self.cross_names)

    def get_encoder(self) -> OrtEncoder:
        return self.encoder

    @takes_the_cache_under_its_old_name
    def forward(
        self,
        input_ids: Any = None,
        attention_mask: Any = None,
        decoder_input_ids: Any = None,
        decoder_attention_mask: Any = None,
        encoder_outputs: OrtEncoderOutput | None = None,
        cache: EncoderDecoderCache | None = None,
        use_cache: bool = True,
        return_dict: bool = True,
        past_key_values: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        """Args as `VaswaniForConditionalGeneration.forward`: the source `input_ids`/`attention_mask` (or
        `encoder_outputs` from `get_encoder()`), the target `decoder_input_ids`, and an `EncoderDecoderCache` of
        earlier calls (updated in place). Decoder padding masks are not supported: the decoder graph attends to
        every target token (generation never pads them)."""
        check_unsupported_arguments(kwargs)
        cache = merge_cache_arguments(cache, past_key_values)
        if decoder_input_ids is None:
            raise ValueError("An encoder-decoder model needs decoder_input_ids (the target tokens read so far).")
        self.check_no_decoder_padding(decoder_attention_mask)
        if cache is not None and not isinstance(cache, EncoderDecoderCache):
            raise TypeError(
                f"cache must be a transformers EncoderDecoderCache (from an earlier call), got {type(cache).__name__}."
            )
        if encoder_outputs is None:
            if input_ids is None:
                raise ValueError("Pass the source input_ids (with their attention_mask), or encoder_outputs.")
            encoder_outputs = self.encoder(input_ids, attention_mask)
        decoder_input_ids = self.graphs["decoder"].convert("input_ids", decoder_input_ids)
        batch = decoder_input_ids.shape[0]
        cross = None
        if cache is not None and cache.is_updated.get(0):
            cross = cache_tensors(cache.cross_attention_cache)
        cross = cross or self.cross_key_values(encoder_outputs, batch)
        self_cache = cache.self_attention_cache if cache is not None else None
        past = cache_tensors(self_cache) or self.empty_past(batch)
        inputs = self.decoder_inputs(decoder_input_ids, attention_mask, cross, past)
        past = [inputs.pop(name) for name in self.past_names]
        buffers = None
        if use_cache:
            if cache is None:
                cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            buffers = self.kv_buffers_for(cache, batch, past[0].shape[2] + decoder_input_ids.shape[1])
        logits, present = self.run_decoding_graph(inputs, past, buffers)
        if use_cache:
            store_in_cache(cache.self_attention_cache, present)
            if not cache.is_updated.get(0):
                store_in_cache(cache.cross_attention_cache, [inputs[name] for name in self.cross_names])
                cache.is_updated = dict.fromkeys(range(len(self.cross_names) // 2), True)
        output = Seq2SeqLMOutput(
            logits=logits,
            **cache_keyword(cache if use_cache else None),
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
        )
        return output if return_dict else output.to_tuple()

    @staticmethod
    def check_no_decoder_padding(decoder_attention_mask: Any) -> None:
        if decoder_attention_mask is not None and not bool((torch.as_tensor(decoder_attention_mask) == 1).all()):
            raise ValueError(
                "The exported decoder graph has no decoder_attention_mask input: it attends to every target token. "
                "Pass unpadded decoder_input_ids (one sequence at a time if their lengths differ)."
            )

    def cross_key_values(self, encoder_outputs: Any, batch: int) -> list[torch.Tensor]:
        """The encoder output's cross-attention keys/values for a decoder batch of `batch` rows. For beams and
        multiple returned sequences generate repeats each source row in `encoder_outputs` and the mask (their
        tensors, not this tuple), so each row of them is repeated here as often, once per generate call."""
        cross = getattr(encoder_outputs, "cross_key_values", None)
        if cross is None:
            raise ValueError(
                "encoder_outputs lack the cross-attention keys/values that the decoder graph reads: pass the output "
                "of model.get_encoder() (an OrtEncoderOutput), or pass input_ids and let the model encode them."
            )
        rows = cross[0].shape[0]
        if batch % rows:
            raise ValueError(
                f"The decoder batch ({batch} rows) is not a multiple of the encoder output's ({rows} rows): pass "
                f"decoder_input_ids with the same number of rows as the source, or each source row repeated "
                f"consecutively the same number of times (as generate does for beams)."
            )
        return list(cross) if batch == rows else [tensor.repeat_interleave(batch // rows, dim=0) for tensor in cross]

    def decoder_inputs(
        self, decoder_input_ids: torch.Tensor, encoder_attention_mask: Any, cross: list[torch.Tensor], past: list
    ) -> dict[str, torch.Tensor]:
        decoder_input_ids = self.graphs["decoder"].convert("input_ids", decoder_input_ids)
        if encoder_attention_mask is None:
            batch, source_length = decoder_input_ids.shape[0], cross[0].shape[2]
            encoder_attention_mask = torch.ones(batch, source_length, dtype=torch.int64, device=self.device)
        return self.graphs["decoder"].prepare(
            {
                "input_ids": decoder_input_ids,
                "encoder_attention_mask": encoder_attention_mask,
                **dict(zip(self.cross_names, cross)),
                **dict(zip(self.past_names, past)),
            }
        )

    def fast_loop_inputs(self, input_ids: torch.Tensor, model_kwargs: dict):
        decoder_attention_mask = model_kwargs.get("decoder_attention_mask")
        if decoder_attention_mask is not None and not bool((decoder_attention_mask == 1).all()):
            return None  # `forward_step` runs forward, which explains why this cannot work
        cross = self.cross_key_values(model_kwargs["encoder_outputs"], input_ids.shape[0])
        inputs = self.decoder_inputs(
            input_ids, model_kwargs.get("attention_mask"), cross, self.empty_past(input_ids.shape[0])
        )
        for name in self.past_names:
            del inputs[name]
        return inputs, inputs.pop("input_ids")

    def forward_arguments(self, input_ids: torch.Tensor, model_kwargs: dict) -> dict[str, Any]:
        names = ("attention_mask", "encoder_outputs", "decoder_attention_mask")
        return {"decoder_input_ids": input_ids, **{name: model_kwargs.get(name) for name in names}}

    def next_forward_arguments(self, arguments: dict[str, Any], tokens: torch.Tensor) -> dict[str, Any]:
        mask = with_new_column(arguments["decoder_attention_mask"])
        return {**arguments, "decoder_input_ids": tokens, "decoder_attention_mask": mask}
