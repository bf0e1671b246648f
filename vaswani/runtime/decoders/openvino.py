"""The OpenVINO runtime (`engine="openvino"`, `pip install 'vaswani[openvino]'`): the portable decoder graph compiled
by OpenVINO for the CPU and made stateful (`openvino.OpenVinoDecoder`), beside ONNX Runtime's session of the same
graph file (opened at the first call left to it). Prompts (calls of more than one token per row) run in OpenVINO; `generate`'s greedy/sampling loop and
the server's running batch run every step in OpenVINO with the cache held inside, where `decodes_in_openvino` says
it was measured faster; other one-token calls (`forward`, beam search, a quantized export's single row unless its
steps compute in f32 and the export is large: `OpenVinoRuntime.decodes_in_openvino`) run in ONNX Runtime. Both
compile the same graph, so each one's present cache is the other's past.

The server's batch is paged (`paged.PagedStepModel`: the same graph in OpenVINO's paged-attention form, each
sequence's cache in blocks of its own, every prompt chunk and decode step in OpenVINO). Where the graph cannot take
that form (no `position_ids`: ALiBi) it is `OpenVinoBatch`, with the portable runtime's `PrefillGroup`: a left-padded
batch whose cache, between OpenVINO's decode steps, stays inside one infer request of the stateful graph, so that a
step feeds only the tokens; joins and leaves read it out and write it back once.

    >>> model = OrtModelForCausalLM.from_pretrained("onnx-folder", engine="openvino")  # bf16 where the CPU has it
    >>> model.decoder_runtime.description
"""

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from ..contract import graph_file_bytes, is_gqa_form, portable_view, positions_from_mask
from ..gqa import GqaDecoder, GqaState
from ..held_cache import held_cache_sample
from ..openvino import (
    OpenVinoDecoder,
    cpu_has_int8_dot_products,
    decode_step_precision,
    openvino_precision,
    route_description,
    unreadable_form_refusal,
)
from ..session import OnFirstUse
from .paged import NotPageable, PagedStepModel
from .portable import Array, OrtStepModel, PortableRuntime, RunningBatch

logger = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
# Graph files (weights, the embedding table included) from which a quantized export's single row decodes in
# OpenVINO's f32 steps rather than in ONNX Runtime: on an Intel Xeon with AMX, ONNX Runtime's steps were faster at
# 135M (int8 and int4, 0.23-0.27 GB of files) and OpenVINO's at 1B (int4 speed-first and int8, 1.8-2.3 GB):
# docs/results/one_row_steps_amx.md. Sizes between were not measured; below the bound they keep ONNX Runtime's.
ONE_ROW_OPENVINO_BYTES = 10**9


class OpenVinoRuntime(PortableRuntime):
    """OpenVINO for prompts and, where faster, decode steps, ONNX Runtime for the rest (the portable runtime, whose
    calls this routes by their length). `provider` reports "OpenVINO (bf16)" or "OpenVINO (f32)"."""

    name = "openvino"
    engine = "openvino"
    title = "OpenVINO"
    auto_reason = (
        "a portable text-generation export (or the portable graph a default export carries), on a CPU that computes "
        "bf16 (any export) or int8 dot products (VNNI or AMX: a quantized export)"
    )

    @classmethod
    def refusal(cls, request) -> str | None:
        task = request.manifest["task"]
        if request.provider != CPU or task != "text-generation":
            return (
                f"engine='openvino' runs text-generation exports on the CPU; {request.folder} holds a {task!r} "
                f"export and {request.provider} was asked for. Use engine='onnxruntime' for it."
            )
        if request.use_io_binding:
            return "engine='openvino' passes numpy arrays; leave use_io_binding unset."
        return unreadable_form_refusal(request.folder, request.manifest)

    @classmethod
    def auto_refusal(cls, manifest: dict, provider: str) -> str | None:
        if manifest["task"] != "text-generation":
            return f"the export's task is {manifest['task']!r} (OpenVINO runs text-generation exports)"
        if provider != CPU:
            return f"it runs on {provider} (OpenVINO runs on the CPU)"
        if is_gqa_form(manifest) and portable_view(manifest) is None:
            reason = "the export is in the GroupQueryAttention form, which only ONNX Runtime runs"
            try:
                slower_here = cls.cpu_refusal(manifest)
            except ImportError:  # no OpenVINO: nothing to suggest
                return reason
            if slower_here is not None:
                return reason
            return (
                f"{reason}, and it carries no portable graph (an export by an earlier vaswani). On this CPU OpenVINO "
                f"would run the portable form, measured faster (docs/deployment.md): export the model again, with "
                f"`vaswani export` (which keeps the portable graph beside this form) or `vaswani export --attention "
                f"portable` (that graph alone)"
            )
        return cls.cpu_refusal(manifest)

    @staticmethod
    def cpu_refusal(manifest: dict) -> str | None:
        """Why OpenVINO measured slower than ONNX Runtime for a portable export like `manifest`'s on this CPU (None:
        it measured faster); raises ImportError without OpenVINO."""
        if openvino_precision("auto") == "bf16":
            return None
        # Without bf16 OpenVINO computes in f32, slower than ONNX Runtime on an AVX2-only CPU
        # (docs/results/openvino_route_135m_avx2.md); with VNNI its int8 products run a quantized export's weights
        # faster, at 135M and 1B (docs/results/openvino_route_135m_avx512.md, benchmark_engines_*_1b_avx512.md).
        if manifest.get("quantization") is None:
            return "this CPU does not compute bfloat16 (OpenVINO in f32 measured slower than ONNX Runtime there)"
        if cpu_has_int8_dot_products():
            return None
        return "this CPU computes neither bfloat16 nor int8 dot products (VNNI, AMX): OpenVINO measured slower there"

    @classmethod
    def load(cls, model: Any, request) -> "OpenVinoRuntime":
        precision = openvino_precision(request.openvino_precision)
        graph = model.graphs[model.decoding_graph]
        options = graph.session_options
        threads = options.intra_op_num_threads  # OpenVINO gets ONNX Runtime's count
        positions = getattr(model.config, "max_position_embeddings", None)
        quantized = model.manifest.get("quantization") is not None
        steps = decode_step_precision(request.openvino_precision, precision, quantized)
        decoder = OpenVinoDecoder(request.folder / graph.file, model.manifest, precision, threads, positions, steps)
        runtime = cls(model, decoder)
        gqa_form = model.manifest.get("gqa_form")  # a default export: `contract.portable_view`
        if gqa_form is not None and not runtime.decodes_in_openvino(1):
            path = request.folder / gqa_form["graphs"][model.decoding_graph]["file"]

            def open_gqa() -> GqaDecoder:
                logger.info("ONNX Runtime opens %s now, for one row's decode steps", path.name)
                session = ort.InferenceSession(str(path), sess_options=options, providers=[CPU])
                return GqaDecoder(session, model.manifest, positions)

            runtime.one_row_steps = OpenVinoPromptGqaSteps(decoder, open_gqa)
        return runtime

    def __init__(self, model: Any, openvino: OpenVinoDecoder):
        super().__init__(model)
        self.openvino = openvino
        self.graph_bytes = graph_file_bytes(openvino.path)  # the weights a step reads
        # One row's generation of a default export, where its steps run in ONNX Runtime: `OpenVinoPromptGqaSteps`.
        self.one_row_steps: OpenVinoPromptGqaSteps | None = None

    @property
    def provider(self) -> str:
        return self.openvino.provider

    @property
    def description(self) -> str:
        one_row = "; one row's steps in its GroupQueryAttention form" if self.one_row_steps is not None else ""
        return route_description(self.provider) + one_row

    def decodes_in_openvino(self, batch: int) -> bool:
        """Whether OpenVINO runs the decode steps of a `batch`-row generation: measured faster for unquantized
        exports at any batch and for quantized ones from two rows (at one row ONNX Runtime's `MatMulNBits` decode
        steps were faster: docs/results/openvino_route_1b_cpu.md). A quantized export's single row too where its
        steps compute in f32 beside bf16 prompts (`openvino.decode_step_precision`) and its graph files hold
        `ONE_ROW_OPENVINO_BYTES` or more: OpenVINO's f32 steps cost a fixed overhead more per call and read the
        weights faster, so they win on large exports and lose on small ones (docs/results/one_row_steps_amx.md)."""
        if self.model.manifest.get("quantization") is None or batch > 1:
            return True
        return self.openvino.splits_steps and self.graph_bytes >= ONE_ROW_OPENVINO_BYTES

    @staticmethod
    def is_prompt(inputs: dict[str, torch.Tensor]) -> bool:
        """A call of more than one token per row: OpenVINO's (the others are ONNX Runtime's)."""
        ids = inputs.get("input_ids")
        return ids is None or ids.dim() < 2 or ids.shape[1] > 1

    def run(self, inputs, past, buffers):
        if not self.is_prompt(inputs):
            return super().run(inputs, past, buffers)
        logits, present = self.run_arrays(inputs, [tensor.numpy() for tensor in past])
        return logits, [torch.from_numpy(array) for array in present]

    def run_arrays(self, inputs, past):
        session = self.openvino if self.is_prompt(inputs) else None  # None: ONNX Runtime's session
        return self.model.decoding.run_arrays(inputs, past, session)

    def sample(self, input_ids, attention_mask, position_ids, logits_processor, stopping_criteria, generation_config):
        loop = (logits_processor, stopping_criteria, generation_config)
        if not self.decodes_in_openvino(input_ids.shape[0]):
            if self.one_row_steps is not None:  # one row (below, every batch decodes in OpenVINO)
                return held_cache_sample(self.one_row_steps, input_ids, attention_mask, position_ids, *loop)
            return None  # the route: prompts in OpenVINO, steps in ONNX Runtime (`run_arrays`)
        return held_cache_sample(self.openvino, input_ids, attention_mask, position_ids, *loop)

    def step_model(
        self, kv_cache_dtype: str = "auto", int8_activations: bool = True
    ) -> "PagedStepModel | OpenVinoStepModel":
        """The paged batch (`paged.PagedStepModel`, its cache in `kv_cache_dtype`: "auto" (the compute precision's
        16-bit type: float16 at f32 compute, bfloat16 at bf16), "float32" or "float16" at f32 compute, "bfloat16" at
        bf16; with `int8_activations=False`, float activations in every call) where the graph takes the paged form,
        else the stateful one. Only a graph the paged form refuses falls back: any other failure is raised."""
        try:
            return PagedStepModel(self.model, self, kv_cache_dtype, int8_activations)
        except NotPageable as error:
            if not int8_activations:
                raise ValueError(
                    f"int8_activations=False (--openvino-int8-activations off) sets the paged batch, which this "
                    f"graph cannot take ({error}); serve it with int8 activations on."
                ) from error
            logger.info(
                "serving with OpenVINO's stateful batch (a copy of the cache at each join and leave): %s", error
            )
            return OpenVinoStepModel(self.model, self)


class OpenVinoPromptGqaSteps:
    """One row's generation of a default export (the GroupQueryAttention form and the portable graph it carries) where
    its decode steps run in ONNX Runtime: the prompt in OpenVINO, the steps in the GroupQueryAttention form, ONNX
    Runtime's fastest for one row, so that one row decodes at ONNX Runtime's own speed or above and its first token
    comes 2.67x-3.54x sooner (docs/results/benchmark_engines_auto_135m_amx.md, _360m_amx.md). A
    `held_cache.HeldCacheDecoder`: the prompt's cache is read out of OpenVINO once, the
    columns padded for AMX dropped, into the in-place buffers the steps append to (`gqa.GqaState`). The form's ONNX
    Runtime session opens at the first row that needs it (`gqa`): a server's batch never does."""

    def __init__(self, openvino: OpenVinoDecoder, open_gqa: Callable[[], GqaDecoder]):
        self.openvino, self._gqa = openvino, OnFirstUse(open_gqa)
        self.max_positions = openvino.max_positions

    @property
    def gqa(self) -> GqaDecoder:
        """The GroupQueryAttention form's decoder, opened on first use."""
        return self._gqa.get()

    @property
    def plain_greedy(self) -> Callable[..., torch.Tensor]:
        return self.gqa.plain_greedy

    def decode(self, state: GqaState, tokens: torch.Tensor) -> torch.Tensor:
        return self.gqa.decode(state, tokens)

    def check_capacity(self, length: int) -> None:
        self.gqa.check_capacity(length)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int) -> tuple:
        if input_ids.shape[0] != 1:
            raise ValueError(f"OpenVinoPromptGqaSteps decodes one row; got {input_ids.shape[0]}.")
        logits, state = self.openvino.prefill(input_ids, attention_mask, capacity)
        real = state.mask[0].astype(bool)  # the prompt's tokens among the columns OpenVINO computed
        count = int(real.sum())
        buffers = self.gqa.new_buffers(1, capacity)
        for buffer, cache in zip(buffers, self.openvino.read_cache(state.request)):
            buffer[:, :, :count] = torch.from_numpy(cache[:, :, real])
        return logits, GqaState.bind(self.gqa, buffers, torch.tensor([count]))


class OpenVinoStepModel(OrtStepModel):
    """The step model of `engine="openvino"`: prompts prefilled by the route (`OrtStepModel`: chunks of several
    tokens in OpenVINO), and running batches whose cache OpenVINO holds between its decode steps (`OpenVinoBatch`)."""

    def __init__(self, model: Any, runtime: "OpenVinoRuntime"):
        super().__init__(model)
        self.runtime = runtime
        self.decoder = runtime.openvino

    def new_batch(self) -> "OpenVinoBatch":
        return OpenVinoBatch(self)


class OpenVinoBatch(RunningBatch):
    """A `RunningBatch` whose decode steps OpenVINO runs on its stateful graph where
    `OpenVinoRuntime.decodes_in_openvino` says so (else ONNX Runtime's, as the route), the cache held in one infer
    request between them: such a step feeds only the tokens, mask and positions. A join, leave or trim reads the cache
    out once (`cache`), `RunningBatch`'s own code edits it, and the next OpenVINO step writes it back."""

    held = False  # whether the cache is in the request rather than in `_cache`

    def __init__(self, model: OpenVinoStepModel):
        self.runtime, self.decoder = model.runtime, model.decoder
        self.request = self.decoder.new_step_request()
        super().__init__(model)

    @property
    def cache(self) -> list[Array]:
        if self.held:
            self._cache, self.held = self.decoder.read_cache(self.request), False
        return self._cache

    @cache.setter
    def cache(self, arrays: list[Array]) -> None:
        self._cache, self.held = arrays, False

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (`tokens`, (batch,)); returns the logits (batch, vocab)."""
        if not self.runtime.decodes_in_openvino(len(self.rows)):
            return super().step(tokens)
        if not self.held:
            self.decoder.write_cache(self.request, self._cache)
            self._cache, self.held = [], True
        mask = np.concatenate([self.mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        positions = positions_from_mask(torch.from_numpy(mask))[:, -1:].numpy()
        logits = self.decoder.infer(self.request, tokens.reshape(-1, 1), mask, positions)
        self.mask = mask
        return logits
