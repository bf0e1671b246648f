"""The ONNX Runtime-only decoder form: each layer's rotary + attention as one `com.microsoft.GroupQueryAttention` node
that reads and writes one preallocated, max-length KV buffer per cache tensor (past and present bound to the same
memory), instead of the portable opset-23 chain (Split, two RotaryEmbedding, Attention, a 2-D mask turned into a
bias) that copies past into present at every step.

Export side (`gqa_form_refusal`, `rewrite_to_gqa`): the portable graph is exported and validated first, then
rewritten in place. Runtime side (`GqaDecoder`): the step that `OrtModelForCausalLM` runs on such a graph, and the
lean greedy/sampling loop over it (`gqa_sample`).

How padding is carried. ONNX Runtime's kernel keeps each row's tokens at the front of its buffer row: row b holds
`seqlens_k[b] + 1` tokens after a step, the new ones at `[P_b, P_b + query_seqlens[b])`, and the chunk of new tokens
is right-padded (`query_seqlens`, honoured by the CPU kernel of onnxruntime >= 1.32). Rotary positions are each
token's index in its row, which is transformers' `cumsum(attention_mask) - 1`. So a left-padded (or any) mask is
carried by compacting each row's attended tokens to its front: exactly what attention over that mask computes, for
every attended token. The graph has no attention mask and no position inputs:

    input_ids [batch, sequence]          the new tokens of each row, right-padded
    seqlens_k [batch] int32              tokens in each row after the step, minus one
    total_sequence_length [] int32       the largest of those counts (an upper bound is allowed)
    query_seqlens [batch] int32          how many of `input_ids`' tokens are real in each row
    past_key_values.{i}.key/.value       [batch, kv_heads, kv_capacity, head_dim]: the buffers
    logits_positions [logits_sequence]   as in the portable graph (positions in the right-padded chunk)
    -> logits, present.{i}.key/.value    present: the same buffers, bound to the same memory

Example:
    >>> decoder = GqaDecoder(session, manifest)
    >>> logits, present = decoder.step_hf(input_ids, attention_mask, past, logits_positions)   # transformers layout
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir
import onnx_ir.external_data
import onnxruntime as ort
import torch
from transformers import PreTrainedModel
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

MS_DOMAIN = "com.microsoft"
FORM_GQA, FORM_PORTABLE = "gqa", "portable"
ATTENTION_FORMS = ("auto", FORM_GQA, FORM_PORTABLE)
# rope types whose angles depend on the position alone; "dynamic" and "longrope" change with the sequence length,
# which a fixed cos/sin table cannot follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GQA_INPUTS = ("seqlens_k", "total_sequence_length", "query_seqlens")


class GqaRewriteError(ValueError):
    """The graph or the model does not fit the GroupQueryAttention form; the message says why."""


# ------------------------------------------------------------------------------------------------ export side


def gqa_form_refusal(model: PreTrainedModel, task: str, dtype: str, device: str) -> str | None:
    """Why `model` cannot take the GroupQueryAttention form, or None when it can. It needs a decoder (causal LM) on
    the CPU in float32 with rotary positions of a static rope type and plain causal self-attention: ONNX Runtime's
    CPU kernel is float32 only, rotates inside the node from one cos/sin table, and adds no other bias."""
    config = model.config
    if task != "text-generation":
        return f"task {task!r} (only decoders' text-generation has it)"
    if device != "cpu" or dtype != "fp32":
        return f"{dtype} on {device} (ONNX Runtime's CPU GroupQueryAttention kernel runs float32)"
    if getattr(config, "position_embedding_type", None) != "rope":
        return f"position_embedding_type={config.position_embedding_type!r} (the fused node's positions are rotary)"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type={rope_type!r} (its angles depend on the sequence length; a fixed table cannot follow)"
    if config.head_dim % 16:
        return f"head_dim={config.head_dim} (ONNX Runtime's kernel needs a multiple of 16)"
    if getattr(config, "sliding_window", None):
        return "a sliding attention window"
    return None


def attention_form_plan(attention: str, quantize: str | None, optimize: bool) -> bool:
    """Whether an export asked for `attention` tries the GroupQueryAttention form: "gqa" always, "auto" for quantized
    and optimized exports (ONNX Runtime-only graphs already), "portable" never."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention={attention!r} is not supported; use one of {list(ATTENTION_FORMS)}.")
    return attention == FORM_GQA or (attention == "auto" and (quantize is not None or optimize))


def rewrite_decoder_attention(
    path: Path, model: PreTrainedModel, task: str, dtype: str, device: str, say: Callable[[str], None]
) -> dict:
    """Rewrite the saved decoder graph at `path` into the GroupQueryAttention form where it applies, else leave the
    portable graph and say why. Returns the manifest entries: `attention_form` and, when portable, the reason in
    `attention_form_note`."""
    refusal = gqa_form_refusal(model, task, dtype, device)
    if refusal is None:
        try:
            layers = rewrite_to_gqa(path, *rope_tables(model))
        except GqaRewriteError as error:
            refusal = str(error)
        else:
            fused = fuse_residual_norms(path)
            say(
                f"Rewrote {layers} attention layers into ONNX Runtime's GroupQueryAttention (in-place KV buffer)"
                + (f", fused {fused} residual Add + RMSNorm pairs" if fused else "")
            )
            return {"attention_form": FORM_GQA}
    say(f"Keeping the portable attention graph: no GroupQueryAttention form for {refusal}")
    return {"attention_form": FORM_PORTABLE, "attention_form_note": f"portable: {refusal}"}


def fuse_residual_norms(path: Path) -> int:
    """`postprocess.fuse_skip_norms` on the saved graph unless done already (quantization does it): the form is
    ONNX Runtime-only anyway, and each fused pair is one dispatch fewer per layer and step."""
    import onnx

    from .contract import save_graph
    from .postprocess import fuse_skip_norms, value_shapes

    if any(node.op_type.startswith("Skip") for node in onnx.load(str(path), load_external_data=False).graph.node):
        return 0
    model = onnx.load(str(path), load_external_data=True)
    fused = fuse_skip_norms(model, value_shapes(model))
    if fused:
        Path(f"{path}.data").unlink()  # every weight is in memory; the file is written anew
        save_graph(model, path)
    return fused


def rope_tables(model: PreTrainedModel) -> tuple[np.ndarray, np.ndarray]:
    """The (max_position_embeddings, rotary_dim / 2) cos and sin tables the node rotates with, computed by the model's
    own rotary module (its rope type and attention scaling included)."""
    rotary = model.get_decoder().positions
    length = model.config.max_position_embeddings
    positions = torch.arange(length)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2  # vaswani's tables hold each frequency twice: cat(freqs, freqs)
    return cos[0, :, :half].float().numpy(), sin[0, :, :half].float().numpy()


def _producer(value: onnx_ir.Value, op_type: str) -> onnx_ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _attribute(node: onnx_ir.Node, name: str, default=None):
    attribute = node.attributes.get(name)
    return default if attribute is None else attribute.value


def rewrite_to_gqa(path, cos: np.ndarray, sin: np.ndarray) -> int:
    """Rewrite the saved decoder graph at `path` in place into the GroupQueryAttention form; returns the number of
    layers rewritten. Raises `GqaRewriteError` (the file untouched) when any self-attention is not the exported
    RotaryEmbedding + Attention pattern over the cache inputs.

    Each layer's Attention(RotaryEmbedding(q), RotaryEmbedding(k), v, mask bias, past) becomes one
    GroupQueryAttention(q, k, v, past, seqlens_k, total_sequence_length, cos, sin, query_seqlens) with `do_rotary=1`;
    when q, k and v are the three parts of one fused projection (`fuse_sibling_matmuls`), the node takes the packed
    projection and the Split goes too. The mask, position and cos/sin subgraphs become dead and are removed with the
    `attention_mask` and `position_ids` inputs.
    """
    from .contract import save_graph

    path = Path(path)
    # Into memory: the rewritten graph is saved over the file its weights were read from.
    model = onnx_ir.external_data.load_to_model(onnx_ir.load(path))
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    attentions = [node for node in graph if node.op_type == "Attention" and node.domain == ""]
    if not attentions:
        raise GqaRewriteError("the graph has no ONNX Attention nodes (export at opset >= 23 on the CPU)")
    batch = inputs["input_ids"].shape[0]
    int32 = onnx_ir.DataType.INT32
    new_inputs = {
        "seqlens_k": onnx_ir.Value(name="seqlens_k", type=onnx_ir.TensorType(int32), shape=onnx_ir.Shape([batch])),
        "total_sequence_length": onnx_ir.Value(
            name="total_sequence_length", type=onnx_ir.TensorType(int32), shape=onnx_ir.Shape([])
        ),
        "query_seqlens": onnx_ir.Value(
            name="query_seqlens", type=onnx_ir.TensorType(int32), shape=onnx_ir.Shape([batch])
        ),
    }
    tables = {}
    for name, array in (("cos_cache", cos), ("sin_cache", sin)):
        tables[name] = onnx_ir.Value(name=f"gqa.{name}", const_value=onnx_ir.tensor(np.ascontiguousarray(array)))
        tables[name].shape, tables[name].dtype = tables[name].const_value.shape, tables[name].const_value.dtype
        graph.register_initializer(tables[name])
    plans = [_layer_plan(node, inputs, cos.shape[1]) for node in attentions]
    for plan in plans:
        attention = plan.attention
        empty = None
        query_inputs = [plan.packed, empty, empty] if plan.packed is not None else [plan.query, plan.key, plan.value]
        gqa = onnx_ir.node(
            "GroupQueryAttention",
            [
                *query_inputs,
                attention.inputs[4],
                attention.inputs[5],
                new_inputs["seqlens_k"],
                new_inputs["total_sequence_length"],
                tables["cos_cache"],
                tables["sin_cache"],
                *[empty] * 7,  # position_ids, attention_bias, head_sink, k/v scales, q/k norm weights
                new_inputs["query_seqlens"],
            ],
            {
                "num_heads": plan.heads,
                "kv_num_heads": plan.kv_heads,
                "scale": plan.scale,
                "do_rotary": 1,
                "rotary_interleaved": 0,
            },
            domain=MS_DOMAIN,
            num_outputs=3,
            name=f"{attention.name or 'attention'}.gqa",
        )
        graph.insert_before(attention, gqa)
        for old, new in zip(attention.outputs[:3], gqa.outputs):
            if old.is_graph_output():
                new.shape, new.type = old.shape, old.type
                index = graph.outputs.index(old)
                name = old.name
                old.name = f"{name}.portable"
                graph.outputs[index] = new
                new.name = name
            else:
                old.replace_all_uses_with(new)
                new.name = old.name + ".gqa"
    for value in new_inputs.values():
        graph.inputs.append(value)
    model.opset_imports[MS_DOMAIN] = 1
    _remove_dead(graph)
    for name in ("attention_mask", "position_ids"):
        value = next((value for value in graph.inputs if value.name == name), None)
        if value is not None:
            if value.uses():
                raise GqaRewriteError(f"the graph still reads {name} after the rewrite (another layer type uses it)")
            graph.inputs.remove(value)
    capacity = "kv_capacity"
    for value in [*graph.inputs, *graph.outputs]:
        if value.name.startswith(("past_key_values.", "present.")):
            dims = list(value.shape.dims)
            value.shape = onnx_ir.Shape([dims[0], dims[1], capacity, dims[3]])
    # The graph input order the manifest lists: ids, the GQA lengths, the buffers, the logits positions.
    order = ["input_ids", *GQA_INPUTS]
    graph.inputs.sort(key=lambda value: order.index(value.name) if value.name in order else len(order))
    save_graph(model, path)
    return len(plans)


@dataclass
class _LayerPlan:
    attention: onnx_ir.Node
    query: onnx_ir.Value
    key: onnx_ir.Value
    value: onnx_ir.Value
    packed: onnx_ir.Value | None
    heads: int
    kv_heads: int
    scale: float


def _layer_plan(attention: onnx_ir.Node, inputs: dict, half_rotary: int) -> _LayerPlan:
    """Check one Attention node against the exported pattern, and say what the fused node will read."""
    name = attention.name or "Attention"
    if len(attention.inputs) < 6 or any(attention.inputs[i] is None for i in (0, 1, 2, 4, 5)):
        raise GqaRewriteError(f"{name} does not extend a cache (cross-attention or no past inputs)")
    past_key, past_value = attention.inputs[4], attention.inputs[5]
    if not (past_key.is_graph_input() and past_value.is_graph_input()):
        raise GqaRewriteError(f"{name} reads its past keys/values from inside the graph, not from the cache inputs")
    if not all(output is not None and output.is_graph_output() for output in attention.outputs[1:3]):
        raise GqaRewriteError(f"{name}'s present keys/values are not graph outputs")
    if len(attention.outputs) > 3 and attention.outputs[3] is not None and attention.outputs[3].uses():
        raise GqaRewriteError(f"{name}'s attention scores are read")
    for attribute in ("is_causal", "softcap", "qk_matmul_output_mode"):
        if _attribute(attention, attribute, 0):
            raise GqaRewriteError(f"{name} has {attribute} set")
    rotations = [_producer(attention.inputs[i], "RotaryEmbedding") for i in (0, 1)]
    if any(rotation is None for rotation in rotations):
        raise GqaRewriteError(f"{name}'s queries/keys are not rotated by RotaryEmbedding nodes (not rotary positions)")
    for rotation in rotations:
        if _attribute(rotation, "interleaved", 0) or len(rotation.inputs) > 3 and rotation.inputs[3] is not None:
            raise GqaRewriteError(f"{rotation.name} is interleaved or reads position ids")
        dim = _attribute(rotation, "rotary_embedding_dim", 0)
        if dim and dim != 2 * half_rotary:
            raise GqaRewriteError(f"{rotation.name} rotates {dim} channels, the table {2 * half_rotary}")
        if len(rotation.outputs[0].uses()) != 1:
            raise GqaRewriteError(f"{rotation.name}'s output is read besides attention")
    heads, kv_heads = _attribute(attention, "q_num_heads"), _attribute(attention, "kv_num_heads")
    if heads is None or kv_heads is None:
        raise GqaRewriteError(f"{name} takes 4-D inputs (no q_num_heads/kv_num_heads)")
    head_dim = past_key.shape[3]
    scale = _attribute(attention, "scale")
    scale = float(scale) if scale is not None else float(head_dim) ** -0.5
    query, key, value = rotations[0].inputs[0], rotations[1].inputs[0], attention.inputs[2]
    split = query.producer()
    packed = None
    if (
        split is not None
        and split.op_type == "Split"
        and list(split.outputs) == [query, key, value]
        and all(len(output.uses()) == 1 for output in split.outputs)
        and _attribute(split, "axis", 0) in (-1, 2)
    ):
        packed = split.inputs[0]
    return _LayerPlan(attention, query, key, value, packed, int(heads), int(kv_heads), scale)


def _remove_dead(graph: onnx_ir.Graph) -> None:
    """Remove nodes none of whose outputs is read or a graph output, then unused initializers."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if not any(output.uses() or output.is_graph_output() for output in node.outputs):
                graph.remove(node, safe=True)
                changed = True
    for name in [name for name, value in graph.initializers.items() if not value.uses()]:
        graph.initializers.pop(name)


# ------------------------------------------------------------------------------------------------ runtime side


def is_gqa_form(manifest: dict) -> bool:
    return manifest.get("attention_form") == FORM_GQA


class GqaDecoder:
    """Drives a GroupQueryAttention-form decoder graph on the CPU through IO binding: the KV buffers are bound as
    both past and present (the kernel appends in place, no copy of the past), logits into a buffer reused per step.

    `step_hf` takes and returns transformers' layout (a padded mask, caches aligned with it) for `forward` and
    validation; `start`/`decode` are the lean loop's (`gqa_sample`).
    """

    def __init__(self, session: ort.InferenceSession, manifest: dict, rotary_positions: int):
        self.session = session
        layers = manifest["num_layers"]
        self.kv_heads, self.head_dim = manifest["num_key_value_heads"], manifest["head_dim"]
        self.vocab = manifest["vocab_size"]
        self.max_positions = rotary_positions
        self.past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
        self.present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]

    # -- binding helpers

    @staticmethod
    def _bind_input(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_input(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())

    @staticmethod
    def _bind_output(binding: ort.IOBinding, name: str, tensor: torch.Tensor) -> None:
        binding.bind_output(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())

    def new_buffers(self, batch: int, capacity: int) -> list[torch.Tensor]:
        if capacity > self.max_positions:
            raise ValueError(
                f"{capacity} tokens (prompt + new) exceed the {self.max_positions} positions of this export's rotary "
                f"table (max_position_embeddings); generate fewer tokens."
            )
        return [torch.zeros(batch, self.kv_heads, capacity, self.head_dim) for _ in self.past_names]

    def run(
        self,
        input_ids: torch.Tensor,
        query_lengths: torch.Tensor,
        total_lengths: torch.Tensor,
        buffers: list[torch.Tensor],
        logits_positions: torch.Tensor,
    ) -> torch.Tensor:
        """One call: `input_ids` (batch, chunk) right-padded with `query_lengths` real tokens per row, rows holding
        `total_lengths` tokens afterwards; the new keys/values land in `buffers`. Returns (batch, positions, vocab)."""
        binding = self.session.io_binding()
        int32 = torch.int32
        feeds = {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "seqlens_k": (total_lengths - 1).to(int32),
            "total_sequence_length": total_lengths.max().to(int32).reshape(()),
            "query_seqlens": query_lengths.to(int32),
            "logits_positions": logits_positions.to(torch.int64).contiguous(),
        }
        for name, tensor in feeds.items():
            self._bind_input(binding, name, tensor)
        for past, present, buffer in zip(self.past_names, self.present_names, buffers):
            self._bind_input(binding, past, buffer)
            self._bind_output(binding, present, buffer)
        logits = torch.empty(input_ids.shape[0], logits_positions.shape[0], self.vocab)
        self._bind_output(binding, "logits", logits)
        self.session.run_with_iobinding(binding)
        return logits

    # -- transformers' layout

    def step_hf(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: list[torch.Tensor] | None,
        logits_positions: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One forward call in transformers' layout: `attention_mask` (batch, past + new), `past` caches aligned with
        its first columns (None or empty: no past), logits at `logits_positions` of the new tokens. Returns the logits
        (batch, positions, vocab; zero where the requested token is padding) and the present caches (batch, kv_heads,
        past + new, head_dim; zero at padding). Each row's attended tokens are compacted to the front of a buffer,
        run, and laid back out along the mask."""
        batch, new = input_ids.shape
        mask = attention_mask.to(torch.bool)
        past_length = mask.shape[1] - new
        past_mask, new_mask = mask[:, :past_length], mask[:, past_length:].clone()
        # A row with no token at all still needs one for the kernel (its outputs are unspecified, as in PyTorch).
        empty = ~(past_mask.any(1) | new_mask.any(1))
        new_mask[empty, -1] = True
        past_counts, query_counts = past_mask.sum(1), new_mask.sum(1)
        chunk = max(int(query_counts.max()), 1)
        capacity = int((past_counts + chunk).max())
        buffers = self.new_buffers(batch, capacity)
        if past_length and past is not None:
            source = _front_indices(past_mask, capacity)
            keep = (torch.arange(capacity)[None] < past_counts[:, None])[:, None, :, None]
            gather = source[:, None, :, None].expand(batch, self.kv_heads, capacity, self.head_dim)
            for buffer, tensor in zip(buffers, past):
                buffer.copy_(torch.gather(tensor.float(), 2, gather) * keep)
        ids = torch.gather(input_ids, 1, _front_indices(new_mask, chunk)) * (
            torch.arange(chunk)[None] < query_counts[:, None]
        )
        # Each requested column's rank among its row's real new tokens (-1: padding).
        rank = torch.where(new_mask, new_mask.cumsum(1) - 1, -1)[:, logits_positions]
        wanted = torch.unique(rank[rank >= 0]) if (rank >= 0).any() else torch.zeros(1, dtype=torch.long)
        logits = self.run(ids, query_counts, past_counts + query_counts, buffers, wanted)
        lookup = torch.searchsorted(wanted, rank.clamp(min=0))
        out = torch.gather(logits, 1, lookup[..., None].expand(-1, -1, self.vocab)) * (rank >= 0)[..., None]
        full = torch.cat([past_mask, new_mask], 1)
        position = (
            (full.cumsum(1) - 1)
            .clamp(min=0)[:, None, :, None]
            .expand(batch, self.kv_heads, full.shape[1], self.head_dim)
        )
        on = full[:, None, :, None]
        present = [torch.gather(buffer, 2, position) * on for buffer in buffers]
        return out, present

    # -- the lean loop

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, capacity: int
    ) -> tuple[torch.Tensor, "GqaState"]:
        """Prefill a (left- or otherwise padded) prompt into buffers of `capacity` tokens per row; the last real
        token's logits of each row (batch, vocab) and the state the decode steps continue from."""
        batch, length = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not bool(mask[:, -1].all()):
            raise _NotLeftPadded
        counts = mask.sum(1)
        ids = torch.gather(input_ids, 1, _front_indices(mask, length)) * (torch.arange(length)[None] < counts[:, None])
        buffers = self.new_buffers(batch, capacity)
        last = counts - 1
        wanted = torch.unique(last)
        logits = self.run(ids, counts, counts, buffers, wanted)
        rows = logits[torch.arange(batch), torch.searchsorted(wanted, last)]
        return rows, GqaState.bind(self, buffers, counts)

    def decode(self, state: "GqaState", tokens: torch.Tensor) -> torch.Tensor:
        """One token per row (batch,) appended in place; the (batch, vocab) logits (a buffer reused every step)."""
        state.step(tokens)
        self.session.run_with_iobinding(state.binding)
        return state.logits[:, 0]


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


def positions_follow_mask(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, shape) -> bool:
    """Whether `position_ids` (None, or those of the last `shape[1]` tokens) are each real token's count of attended
    tokens before it, which is what the GroupQueryAttention form rotates by (generate passes exactly those)."""
    if position_ids is None:
        return True
    batch, length = shape
    mask = torch.ones(batch, length, dtype=torch.long) if attention_mask is None else torch.as_tensor(attention_mask)
    expected = (mask.cumsum(-1) - 1)[:, -length:]
    real = mask[:, -length:].bool()
    return torch.equal(torch.as_tensor(position_ids).expand(batch, -1)[real], expected[real])


class _NotLeftPaddedError(Exception):
    """The prompt's last column holds padding: the lean loop hands the call to transformers' loop."""


_NotLeftPadded = _NotLeftPaddedError()


def _front_indices(mask: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, width) column indices that bring each row's True columns to its front, in order (the rest repeat
    column 0; callers zero them)."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    if order.shape[1] < width:
        order = torch.cat([order, order.new_zeros(order.shape[0], width - order.shape[1])], 1)
    return order[:, :width]


@dataclass
class GqaState:
    """A decode step's bound inputs and outputs, updated in place: the binding is made once per generate call."""

    binding: ort.IOBinding
    tokens: torch.Tensor  # (batch, 1) int64
    seqlens: torch.Tensor  # (batch,) int32: tokens held minus one
    total: torch.Tensor  # () int32
    logits: torch.Tensor  # (batch, 1, vocab)
    keep: list  # the bound tensors' owners

    @classmethod
    def bind(cls, decoder: GqaDecoder, buffers: list[torch.Tensor], counts: torch.Tensor) -> "GqaState":
        batch = counts.shape[0]
        binding = decoder.session.io_binding()
        tokens = torch.zeros(batch, 1, dtype=torch.int64)
        seqlens = (counts - 1).to(torch.int32)
        total = counts.max().to(torch.int32).reshape(()).clone()  # each step adds one before it runs
        ones = torch.ones(batch, dtype=torch.int32)
        positions = torch.zeros(1, dtype=torch.int64)
        logits = torch.empty(batch, 1, decoder.vocab)
        feeds = {
            "input_ids": tokens,
            "seqlens_k": seqlens,
            "total_sequence_length": total,
            "query_seqlens": ones,
            "logits_positions": positions,
        }
        for name, tensor in feeds.items():
            decoder._bind_input(binding, name, tensor)
        for past, present, buffer in zip(decoder.past_names, decoder.present_names, buffers):
            decoder._bind_input(binding, past, buffer)
            decoder._bind_output(binding, present, buffer)
        decoder._bind_output(binding, "logits", logits)
        return cls(binding, tokens, seqlens, total, logits, [buffers, ones, positions])

    def step(self, tokens: torch.Tensor) -> None:
        self.tokens[:, 0] = tokens
        self.seqlens += 1
        self.total += 1


def gqa_sample(
    decoder: GqaDecoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    logits_processor,
    stopping_criteria,
    generation_config,
    processors_for: Callable,
    apply_processors: Callable,
    greedy_tokens: Callable,
) -> torch.Tensor | None:
    """The lean greedy/sampling loop (`OrtModelForGeneration._sample`) on a GroupQueryAttention-form graph: the same
    processors, stopping criteria and random draws, one preallocated buffer per cache tensor for the whole call, and
    per step only the token, two lengths and the run. Returns None when the prompt is not left-padded (its last
    column is padding) or `position_ids` are not the mask's: transformers' loop then runs it through `forward`."""
    batch, length = input_ids.shape
    if not positions_follow_mask(position_ids, attention_mask, input_ids.shape):
        return None  # other positions than the mask's: `forward` says why it cannot run them
    capacity = max(generation_config.max_length, length + 1)
    try:
        next_logits, state = decoder.start(input_ids, attention_mask, min(capacity, decoder.max_positions))
    except _NotLeftPaddedError:
        return None
    # The sequences so far, in one preallocated tensor: each step writes a column and the processors and criteria
    # see a view (no concatenation per token).
    ids = torch.empty(batch, capacity, dtype=input_ids.dtype)
    ids[:, :length] = input_ids
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    stops = StandardStops.of(stopping_criteria)
    unfinished = torch.ones(batch, dtype=torch.long)
    processors = processors_for(logits_processor)
    while True:
        scores = apply_processors(processors, ids[:, :length], next_logits)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = greedy_tokens(scores)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        ids[:, length] = next_tokens
        length += 1
        if stops is not None:
            unfinished &= ~stops(ids[:, :length])
        else:
            unfinished = unfinished & ~stopping_criteria(ids[:, :length], None)
        if not unfinished.any():
            return ids[:, :length].clone()
        if length >= decoder.max_positions:
            raise ValueError(
                f"Generation reached the {decoder.max_positions} positions of this export's rotary table "
                f"(max_position_embeddings); ask for fewer tokens."
            )
        next_logits = decoder.decode(state, next_tokens)


@dataclass
class StandardStops:
    """transformers' `MaxLengthCriteria` and `EosTokenCriteria` (what generate builds from `max_length` and the
    end-of-sequence ids) evaluated in one step: the same decisions, without the list's per-criterion dispatch and
    full-batch tensors (0.1 ms a token)."""

    max_length: int | None
    eos_token_id: torch.Tensor | None

    @classmethod
    def of(cls, criteria) -> "StandardStops | None":
        """The two standard criteria of `criteria`, or None if it holds any other kind."""
        max_length = eos = None
        for criterion in criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria and eos is None:
                eos = criterion.eos_token_id
            else:
                return None
        return cls(max_length, eos)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.max_length is not None and input_ids.shape[1] >= self.max_length:
            return torch.ones(input_ids.shape[0], dtype=torch.bool)
        if self.eos_token_id is None:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return torch.isin(input_ids[:, -1], self.eos_token_id)


class GqaValidationRunner:
    """`validation._GraphRunner`'s interface over a GroupQueryAttention-form graph: fed and read in the portable
    graph's layout (mask, positions, caches aligned with the mask), so that validation compares it with PyTorch as it
    compares the portable graph. Positions are the mask's (`cumsum - 1`), which is what validation feeds."""

    def __init__(self, runner, manifest: dict, rotary_positions: int):
        self.runner, self.name, self.inputs = runner, runner.name, runner.inputs
        self.decoder = GqaDecoder(runner.session, manifest, rotary_positions)
        outputs = []
        for spec in runner.graph["outputs"]:
            shape = list(spec["shape"])
            if spec["name"].startswith("present."):
                shape[2] = "past_sequence + sequence"
            outputs.append({**spec, "shape": shape})
        self.graph = {**runner.graph, "outputs": outputs}

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return self.runner.empty_past(batch)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        past = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in self.decoder.past_names]
        logits, present = self.decoder.step_hf(
            torch.from_numpy(feeds["input_ids"]),
            torch.from_numpy(feeds["attention_mask"]),
            past,
            torch.from_numpy(np.asarray(feeds["logits_positions"])),
        )
        return {"logits": logits.numpy(), **{name: t.numpy() for name, t in zip(self.decoder.present_names, present)}}

    def compare(self, *args, **kwargs) -> None:
        type(self.runner).compare(self, *args, **kwargs)
