"""The formulations vaswani blocks take only while tracing: fewer, fusable ONNX nodes, the same numbers up to float
rounding (validation checks every export). PyTorch's own code stays the numerical reference.

A new export-only rewrite of a block goes here, switched on inside `exporting_formulations`; rewrites of the traced
graph itself (`fuse_sibling_matmuls`) run right after tracing.
"""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import onnx_ir
import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..modeling.layers import RMSNorm, VaswaniAttention, eager_attention_forward

# The first ONNX opset with Attention (grouped-query, extending a KV cache) and RotaryEmbedding operators, which ONNX
# Runtime runs as one kernel each instead of about twenty small nodes per layer (checked with onnxruntime 1.31;
# older runtimes may lack the kernels).
LLM_OPSET = 23


@contextmanager
def exporting_formulations(model: nn.Module, llm_ops: bool) -> Iterator[None]:
    """Trace `model` in formulations that export to few, fusable ONNX nodes; all is restored after the block.

    PyTorch's own code stays the numerical reference (exact parity with transformers); these compute the same up
    to float rounding, which validation checks on every export:
    - attention runs through `float32_attention` (eager math, float32 scores) whatever backend the model was
      loaded with;
    - RMSNorm divides by the root mean square instead of multiplying by its rsqrt: ONNX Runtime fuses that form
      into one SimplifiedLayerNormalization node, the other stays six nodes;
    - with `llm_ops` (opset >= `LLM_OPSET`), attention is `llm_attention`: ONNX RotaryEmbedding and Attention
      nodes.
    The formulations are set on `model`'s own RMSNorm and VaswaniAttention modules, not on their classes: other
    models (another thread's export or forward) keep their code meanwhile.
    """
    models = outermost_models(model)
    saved = [(pretrained, pretrained.config._attn_implementation) for pretrained in models]
    for pretrained in models:
        pretrained.set_attn_implementation(EXPORT_ATTENTION)  # reaches the stacks' own configs too
    try:
        with ExitStack() as patches:
            patches.enter_context(_forward_replaced(model, RMSNorm, fusable_rms_norm))
            if llm_ops:
                patches.enter_context(_forward_replaced(model, VaswaniAttention, llm_attention))
            yield
    finally:
        for pretrained, backend in saved:
            pretrained.set_attn_implementation(backend)


def outermost_models(model: nn.Module) -> list[PreTrainedModel]:
    """The transformers models in `model` (itself, or those an export wrapper holds) that no other one contains."""
    inner = {
        id(child)
        for module in model.modules()
        if isinstance(module, PreTrainedModel)
        for child in module.modules()
        if child is not module
    }
    return [module for module in model.modules() if isinstance(module, PreTrainedModel) and id(module) not in inner]


def module_configs(model: nn.Module) -> dict[int, PreTrainedConfig]:
    """The distinct configs `model`'s modules hold (an encoder-decoder's stacks may hold their own), by id."""
    return {
        id(module.config): module.config
        for module in model.modules()
        if isinstance(getattr(module, "config", None), PreTrainedConfig)
    }


@contextmanager
def _forward_replaced(model: nn.Module, kind: type[nn.Module], forward: Callable) -> Iterator[None]:
    """`forward` as the forward of each `kind` module in `model` (an instance attribute, which `nn.Module.__call__`
    finds before the class's); any instance forward a module had before is restored after."""
    modules = [module for module in model.modules() if isinstance(module, kind)]
    saved = [(module, module.__dict__.get("forward")) for module in modules]
    for module in modules:
        module.forward = forward.__get__(module)
    try:
        yield
    finally:
        for module, previous in saved:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def float32_attention(module: nn.Module, query, key, value, attention_mask, position_bias=None, **kwargs):
    """Eager attention computed in float32 (fp16 scores overflow), its output cast back to the model's dtype (a
    no-op in fp32 models). Traced through sdpa instead, some position types failed to export (relative_bias) or
    gave wrong prompt logits in ONNX Runtime (none); the plain math exports every one faithfully."""
    mask = attention_mask.float() if attention_mask is not None else None
    bias = position_bias.float() if position_bias is not None else None
    output, probs = eager_attention_forward(
        module, query.float(), key.float(), value.float(), mask, position_bias=bias, **kwargs
    )
    return output.to(query.dtype), probs


EXPORT_ATTENTION = "vaswani_onnx_export"
ALL_ATTENTION_FUNCTIONS.register(EXPORT_ATTENTION, float32_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(EXPORT_ATTENTION, eager_mask)


def fusable_rms_norm(self: RMSNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """`RMSNorm.forward` with `x / sqrt(mean(x^2) + eps)` for `x * rsqrt(mean(x^2) + eps)`."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states / torch.sqrt(variance + self.eps)
    return self.weight * hidden_states.to(input_dtype)


_vaswani_attention_forward = VaswaniAttention.forward


def llm_attention(
    self: VaswaniAttention,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    position_bias: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`VaswaniAttention.forward` as ONNX Attention nodes: self-attention after two RotaryEmbedding nodes, and
    cross-attention over the keys/values the encoder graph projected (`cross_attention_from_cache`).

    Self-attention takes the (batch, tokens, heads * head_dim) projections as they come (no head reshapes or
    transposes), Attention appends the new keys/values to the cache itself and serves each query group from its
    shared key/value head (no repeat_kv copies), and the mask and position bias (ALiBi, relative) enter as one
    additive bias. Scores and softmax are float32, as in `float32_attention`. A cache this cannot extend (none
    initialized for the layer), and cross-attention that projects its own keys/values, take the original path.
    """
    if self.is_cross_attention:
        return cross_attention_from_cache(self, hidden_states, attention_mask, cache, **kwargs)
    self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    layer = self_cache.layers[self.layer_idx] if self_cache is not None else None
    extendable = layer is None or (isinstance(layer, DynamicLayer) and layer.is_initialized)
    if not extendable:
        return _vaswani_attention_forward(
            self, hidden_states, attention_mask, position_embeddings, position_bias, cache, **kwargs
        )
    heads, key_value_heads = self.config.num_attention_heads, self.config.num_key_value_heads
    query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
    if position_embeddings is not None:
        # The op takes each frequency once (vaswani's cos/sin hold them twice: `cat(freqs, freqs)`), for every row of
        # the batch (default position ids are one row for all).
        batch = hidden_states.shape[0]
        cos, sin = (table[..., : table.shape[-1] // 2].expand(batch, -1, -1) for table in position_embeddings)
        query = torch.onnx.ops.rotary_embedding(query, cos, sin, num_heads=heads)
        key = torch.onnx.ops.rotary_embedding(key, cos, sin, num_heads=key_value_heads)
    bias = attention_mask.float() if attention_mask is not None else None
    if position_bias is not None:
        bias = position_bias.float() if bias is None else bias + position_bias.float()
    past = (layer.keys.float(), layer.values.float()) if layer is not None else (None, None)
    output, keys, values, _ = torch.onnx.ops.attention(
        query.float(),
        key.float(),
        value.float(),
        bias,
        *past,
        q_num_heads=heads,
        kv_num_heads=key_value_heads,
        scale=self.scaling,
    )
    if layer is not None:
        # What `cache.update` would hold: the past and the new keys/values, in the model's dtype.
        layer.keys, layer.values = keys.to(key.dtype), values.to(value.dtype)
    return self.o_proj(output.to(hidden_states.dtype)), None


def cross_attention_from_cache(
    self: VaswaniAttention,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Cross-attention over the cached (encoder-projected) keys/values as one ONNX Attention node instead of about
    ten (transposes, two MatMuls, scale, mask, softmax): the decoder graph of a small encoder-decoder runs a few
    hundred nodes per token, and each costs dispatch time. The op wants queries of the keys' rank, hence the head
    reshape around it. Without a filled cross cache (the keys are projected here), the original path."""
    filled = isinstance(cache, EncoderDecoderCache) and cache.is_updated.get(self.layer_idx)
    if not filled:
        return _vaswani_attention_forward(self, hidden_states, attention_mask, None, None, cache, **kwargs)
    layer = cache.cross_attention_cache.layers[self.layer_idx]
    batch, length = hidden_states.shape[:2]
    query = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
    bias = attention_mask.float() if attention_mask is not None else None
    output, *_ = torch.onnx.ops.attention(
        query.float(),
        layer.keys.float(),
        layer.values.float(),
        bias,
        q_num_heads=self.config.num_attention_heads,
        kv_num_heads=self.config.num_key_value_heads,
        scale=self.scaling,
    )
    output = output.to(hidden_states.dtype).transpose(1, 2).reshape(batch, length, -1)
    return self.o_proj(output), None


def fuse_sibling_matmuls(model: onnx_ir.Model) -> int:
    """Merge the MatMuls that multiply one activation by constant weights (q/k/v projections, gate/up) into one
    MatMul over the weights concatenated along their output axis, followed by a Split. Returns how many MatMuls it
    removed.

    Why: decoding one token is a matrix-vector product per MatMul, bound by reading the weights; ONNX Runtime
    dispatches each to its thread pool, and a narrow one (a 192-wide GQA key projection) leaves threads idle. One
    wide product reads the same bytes in fewer, better-balanced dispatches. The result is plain ONNX (MatMul and
    Split), block-wise quantizers treat the fused weight as they would each part, and the numbers are unchanged
    (each output column is the same dot product).
    """
    graph = model.graph
    groups: dict[onnx_ir.Value, list[onnx_ir.Node]] = {}
    for node in graph:
        weight = node.inputs[1] if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2 else None
        if (
            weight is not None
            and weight.is_initializer()
            and weight.const_value is not None
            and len(weight.shape) == 2
            and len(weight.uses()) == 1  # a weight shared with another node (a tied embedding) stays as it is
            and not node.outputs[0].is_graph_output()
        ):
            groups.setdefault(node.inputs[0], []).append(node)
    removed = 0
    for activation, nodes in groups.items():
        dtypes = {node.inputs[1].dtype for node in nodes}
        if len(nodes) < 2 or len(dtypes) != 1:
            continue
        weights = [node.inputs[1] for node in nodes]
        name = nodes[0].name or weights[0].name
        # Each product's bias addition, if every one has one: they become one addition before the Split.
        bias_adds = [_bias_addition(node) for node in nodes]
        biased = all(add is not None for add in bias_adds)
        widths = [weight.const_value.shape[1] for weight in weights]
        constants = {"fused_weight": _concatenated([weight.const_value for weight in weights])}
        constants["fused_widths"] = onnx_ir.tensor(np.array(widths, np.int64))
        biases = [_constant_input(add) for add in bias_adds] if biased else []
        if biased:
            constants["fused_bias"] = onnx_ir.tensor(np.concatenate([bias.const_value.numpy() for bias in biases]))
        values = {}
        for key, tensor in constants.items():
            values[key] = onnx_ir.Value(name=f"{name}.{key}", const_value=tensor)
            values[key].shape, values[key].dtype = values[key].const_value.shape, values[key].const_value.dtype
            graph.register_initializer(values[key])
        product = onnx_ir.node("MatMul", [activation, values["fused_weight"]], name=f"{name}.fused")
        new_nodes = [product]
        if biased:
            new_nodes.append(onnx_ir.node("Add", [product.outputs[0], values["fused_bias"]], name=f"{name}.fused_bias"))
        split = onnx_ir.node(
            "Split", [new_nodes[-1].outputs[0], values["fused_widths"]], {"axis": -1}, num_outputs=len(nodes)
        )
        graph.insert_before(nodes[0], [*new_nodes, split])
        replaced = bias_adds if biased else nodes
        for node, part in zip(replaced, split.outputs):
            part.name = node.outputs[0].name + ".part"
            node.outputs[0].replace_all_uses_with(part)
        graph.remove([*replaced, *(nodes if biased else [])], safe=True)
        for initializer in {value.name: value for value in [*weights, *biases]}.values():  # equal biases may be one
            if not initializer.uses():
                graph.initializers.pop(initializer.name)
        removed += len(nodes) - 1
    return removed


def _concatenated(parts: list[onnx_ir.TensorProtocol]) -> onnx_ir.TensorProtocol:
    """The 2-D `parts` side by side (along the output axis), concatenated only when read or written: one fused weight
    at a time in memory, not every fused weight of the model at once beside the model itself."""
    rows = parts[0].shape[0]
    return onnx_ir.LazyTensor(
        lambda: onnx_ir.tensor(np.concatenate([part.numpy() for part in parts], 1)),
        dtype=parts[0].dtype,
        shape=onnx_ir.Shape([rows, sum(part.shape[1] for part in parts)]),
    )


def _constant_input(add: onnx_ir.Node) -> onnx_ir.Value:
    return next(value for value in add.inputs if value.is_initializer())


def _bias_addition(matmul: onnx_ir.Node) -> onnx_ir.Node | None:
    """The Add of a 1-D constant bias that is the only reader of `matmul`'s product, else None."""
    uses = list(matmul.outputs[0].uses())
    if len(uses) != 1 or uses[0].node.op_type != "Add" or uses[0].node.domain != "":
        return None
    add = uses[0].node
    constants = [value for value in add.inputs if value.is_initializer() and value.const_value is not None]
    width = matmul.inputs[1].shape[1]
    if len(constants) != 1 or constants[0].shape != onnx_ir.Shape([width]) or add.outputs[0].is_graph_output():
        return None
    return add
