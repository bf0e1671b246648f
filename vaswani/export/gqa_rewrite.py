"""The ONNX Runtime-only decoder form: each layer's rotary + attention as one `com.microsoft.GroupQueryAttention` node
that reads and writes one preallocated, max-length KV buffer per cache tensor (past and present bound to the same
memory), instead of the portable opset-23 chain (Split, two RotaryEmbedding, Attention, a 2-D mask turned into a
bias) that copies past into present at every step.

This module is the export side (`gqa_form_refusal`, `rewrite_to_gqa`): the portable graph is exported (and, for
quantized exports, validated) first, then rewritten in place. `runtime/gqa.py` drives the rewritten graph.

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
    >>> form = rewrite_decoder_attention(folder / "model.onnx", model, "text-generation", "fp32", "cpu", print)
    >>> form["attention_form"]   # "gqa", or "portable" with the reason in form["attention_form_note"]
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir
import onnx_ir.external_data
import torch
from onnx_ir.passes.common import RemoveUnusedNodesPass
from transformers import PreTrainedModel

from ..modeling.positions import registered_position_type
from ..runtime.contract import FORM_GQA, FORM_PORTABLE

MS_DOMAIN = "com.microsoft"
ATTENTION_FORMS = ("auto", FORM_GQA, FORM_PORTABLE)
# rope types whose angles depend on the position alone; "dynamic" and "longrope" change with the sequence length,
# which a fixed cos/sin table cannot follow.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GQA_INPUTS = ("seqlens_k", "total_sequence_length", "query_seqlens")

logger = logging.getLogger(__name__)


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
    positions = registered_position_type(getattr(config, "position_embedding_type", None))
    if positions is None or not positions.onnx_gqa:
        return f"position_embedding_type={config.position_embedding_type!r} (the fused node's positions are rotary)"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type={rope_type!r} (its angles depend on the sequence length; a fixed table cannot follow)"
    if config.head_dim % 16:
        return f"head_dim={config.head_dim} (ONNX Runtime's kernel needs a multiple of 16)"
    if getattr(config, "sliding_window", None):
        return "a sliding attention window"
    return None


def attention_form_plan(attention: str, quantized: bool, optimize: bool) -> bool:
    """Whether an export asked for `attention` tries the GroupQueryAttention form: "gqa" always, "auto" for quantized
    and optimized exports (ONNX Runtime-only graphs already), "portable" never."""
    if attention not in ATTENTION_FORMS:
        raise ValueError(f"attention={attention!r} is not supported; use one of {list(ATTENTION_FORMS)}.")
    return attention == FORM_GQA or (attention == "auto" and (quantized or optimize))


def rewrite_decoder_attention(
    path: Path, model: PreTrainedModel, task: str, dtype: str, device: str, say: Callable[[str], None]
) -> dict:
    """Rewrite the saved decoder graph at `path` into the GroupQueryAttention form where it applies, else leave the
    portable graph and say why (logged too: as a warning where the rewrite failed, as info where the model does not
    take the form). Returns the manifest entries: `attention_form` and, when portable, the reason in
    `attention_form_note`."""
    refusal = gqa_form_refusal(model, task, dtype, device)
    level = logging.INFO
    if refusal is None:
        try:
            layers = rewrite_to_gqa(path, *rope_tables(model))
        except GqaRewriteError as error:
            refusal, level = str(error), logging.WARNING
        else:
            fused = fuse_residual_norms(path)
            say(
                f"Rewrote {layers} attention layers into ONNX Runtime's GroupQueryAttention (in-place KV buffer)"
                + (f", fused {fused} residual Add + RMSNorm pairs" if fused else "")
            )
            return {"attention_form": FORM_GQA}
    say(f"Keeping the portable attention graph: no GroupQueryAttention form for {refusal}")
    logger.log(level, "Keeping the portable attention graph of %s: no GroupQueryAttention form for %s", path, refusal)
    return {"attention_form": FORM_PORTABLE, "attention_form_note": f"portable: {refusal}"}


def fuse_residual_norms(path: Path) -> int:
    """`postprocess.fuse_skip_norms` on the saved graph unless done already (quantization does it): the form is
    ONNX Runtime-only anyway, and each fused pair is one dispatch fewer per layer and step."""
    import onnx

    from ..runtime.contract import save_graph
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
    from ..runtime.contract import save_graph

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
    RemoveUnusedNodesPass()(model)  # the replaced rotary, mask and position subgraphs, and their constants
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
