"""The ONNX Runtime-only attention of an encoder-decoder's decoder graph: each opset-23 `Attention` node becomes ONNX
Runtime's contrib `MultiHeadAttention`, with the masks it read replaced by the op's own (causal self-attention, the
source's padding as a key padding mask) and the reshapes around the cross-attention dropped.

Why: a BART-shaped decoder step is small (a 512-wide token through 6 layers), so per-node dispatch and the mask
arithmetic rebuilt at every step are a visible share of it. The exported decoder builds both masks from shapes and
`encoder_attention_mask` (about 35 nodes a step) and wraps each cross-attention in Reshape/Transpose pairs, because
the opset-23 op wants the query in the 4-D layout of the cached keys. `MultiHeadAttention` takes the 3-D query with
the cached 4-D cross keys/values, masks causally itself (`unidirectional`, offset by the past length) and takes the
padding as a (batch, source) mask: the decoder graph keeps its inputs and outputs, with about 40% fewer nodes.

Applied to the decoder graph of quantized and `optimize` text2text-generation exports (which are ONNX Runtime-only
already); the portable export keeps the standard op. Validation against PyTorch runs on the rewritten graph (several
decoder tokens per step after a past, padded sources), which is what shows that the masks it replaced were the causal
and padding masks this rewrite assumes.

    >>> model = onnx.load("decoder_model.onnx")
    >>> fuse_decoder_attention(model, source_mask="encoder_attention_mask")
    12
"""

from pathlib import Path

import onnx

from ..runtime.contract import save_graph

CONTRIB = "com.microsoft"
HEAD_TRANSPOSE = [0, 2, 1, 3]  # (batch, sequence, heads, head_dim) <-> (batch, heads, sequence, head_dim)
# The opset-23 Attention options that MultiHeadAttention has no counterpart for, at the values that leave it unchanged.
OPTION_DEFAULTS = {"is_causal": 0, "qk_matmul_output_mode": 0, "softcap": 0.0}


def fuse_decoder_attention(model: onnx.ModelProto, source_mask: str = "encoder_attention_mask") -> int:
    """Rewrite, in place, the decoder's self-attention (with a past) and cross-attention `Attention` nodes into
    `MultiHeadAttention`; returns how many were rewritten. Nodes that match neither form are left as they are."""
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_inputs = {value.name for value in graph.input}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    key_padding = f"{source_mask}.int32"
    replacements: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    merges: list[onnx.NodeProto] = []  # the Transpose and Reshape after each cross-attention, which its output replaces
    for node in graph.node:
        num_heads = _plain_heads(node) if node.op_type == "Attention" and node.domain in ("", "ai.onnx") else None
        if num_heads is None:
            continue
        inputs = list(node.input) + [""] * (7 - len(node.input))
        query, key, value, mask, past_key, past_value, lengths = inputs[:7]
        scale = [attribute for attribute in node.attribute if attribute.name == "scale"]
        if past_key and past_value and not lengths and len(node.output) >= 3 and node.output[1] and node.output[2]:
            # Self-attention over the cache: 3-D query/key/value (batch, sequence, heads x head_dim), not split into
            # heads, and a keep/drop mask computed from shapes only (no input's values: the causal mask; the decoder
            # graph has no padding input).
            if (
                not mask
                or any(_unheaded(name, producers) is not None for name in (query, key, value))
                or not _is_boolean_mask(mask, producers, constants)
                or _reads_inputs(mask, producers, graph_inputs)
            ):
                continue
            merge = []
            fused = onnx.helper.make_node(
                "MultiHeadAttention",
                [query, key, value, "", "", "", past_key, past_value],
                list(node.output[:3]),
                name=f"{node.name}.mha",
                domain=CONTRIB,
                num_heads=num_heads,
                unidirectional=1,
            )
        elif not (past_key or past_value or lengths) and source_mask in graph_inputs:
            # Cross-attention: the query (batch, heads, 1.., head_dim) is Transpose(Reshape(3-D)), the output goes
            # back through Transpose and Reshape; keys/values are the encoder's 4-D projections.
            flat_query = _unheaded(query, producers)
            merge = _reheaded(node.output[0], readers)
            if flat_query is None or merge is None or len(node.output) > 1 and any(node.output[1:]):
                continue
            flat_output = merge[-1].output[0]
            if mask and (
                not _is_boolean_mask(mask, producers, constants)
                or _reads_inputs(mask, producers, graph_inputs) != {source_mask}
            ):
                continue
            fused = onnx.helper.make_node(
                "MultiHeadAttention",
                [flat_query, key, value, "", key_padding if mask else ""],
                [flat_output],
                name=f"{node.name}.mha",
                domain=CONTRIB,
                num_heads=num_heads,
            )
        else:
            continue
        fused.attribute.extend(scale)
        replacements.append((node, fused))
        merges += merge
    if not replacements:
        return 0
    for old, new in replacements:
        graph.node.insert(list(graph.node).index(old), new)
        graph.node.remove(old)
    for node in merges:
        graph.node.remove(node)
    if any(key_padding in new.input for _, new in replacements):
        cast = onnx.helper.make_node("Cast", [source_mask], [key_padding], name=key_padding, to=onnx.TensorProto.INT32)
        graph.node.insert(0, cast)
    _drop_unused(graph)
    if not any(entry.domain == CONTRIB for entry in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(CONTRIB, 1))
    return len(replacements)


def fuse_decoder_attention_file(path: Path) -> int:
    """`fuse_decoder_attention` on the graph saved at `path` (weights in `<file>.data`), saved back in place."""
    model = onnx.load(str(path), load_external_data=True)
    fused = fuse_decoder_attention(model)
    if fused:
        for stale in (path, Path(f"{path}.data")):
            stale.unlink(missing_ok=True)
        save_graph(model, path)
    return fused


def _plain_heads(node: onnx.NodeProto) -> int | None:
    """The head count of an `Attention` node with as many key/value heads as query heads (both recorded) and no
    option `MultiHeadAttention` lacks (options at their defaults, as ONNX Runtime's optimizer writes them, are fine),
    else None."""
    attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}
    options = {
        name: value for name, value in attributes.items() if name not in ("q_num_heads", "kv_num_heads", "scale")
    }
    heads = attributes.get("q_num_heads")
    if any(OPTION_DEFAULTS.get(name, object()) != value for name, value in options.items()):
        return None
    if not heads or attributes.get("kv_num_heads") != heads:
        return None
    return heads


def _is_boolean_mask(mask: str, producers: dict[str, onnx.NodeProto], constants: dict[str, onnx.TensorProto]) -> bool:
    """Whether the additive `mask` is Where(condition, 0, a large negative number): a pure keep/drop mask, with no
    bias added (a relative position bias, say) that `MultiHeadAttention`'s own masking would lose."""
    where = producers.get(mask)
    if where is None or where.op_type != "Where" or not all(name in constants for name in where.input[1:]):
        return False
    keep, drop = (onnx.numpy_helper.to_array(constants[name]) for name in where.input[1:])
    return keep.size == 1 and drop.size == 1 and float(keep) == 0.0 and float(drop) <= -1e4


def _reads_inputs(name: str, producers: dict[str, onnx.NodeProto], graph_inputs: set[str]) -> set[str]:
    """The graph inputs whose values (not just shapes) `name` is computed from."""
    found, stack, seen = set(), [name], set()
    while stack:
        current = stack.pop()
        if current in seen or not current:
            continue
        seen.add(current)
        if current in graph_inputs:
            found.add(current)
            continue
        node = producers.get(current)
        if node is not None and node.op_type != "Shape":  # a Shape reads its input's shape, not its values
            stack.extend(node.input)
    return found


def _unheaded(query: str, producers: dict[str, onnx.NodeProto]) -> str | None:
    """The 3-D tensor that `query` = Transpose(Reshape(it), perm (0, 2, 1, 3)) splits into heads, else None."""
    transpose = producers.get(query)
    if transpose is None or transpose.op_type != "Transpose" or _perm(transpose) != HEAD_TRANSPOSE:
        return None
    reshape = producers.get(transpose.input[0])
    return reshape.input[0] if reshape is not None and reshape.op_type == "Reshape" else None


def _reheaded(output: str, readers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto] | None:
    """The Transpose (0, 2, 1, 3) and Reshape that merge the heads of `output` back into a 3-D tensor (each the
    only reader of the value before it), else None."""
    transposes = readers.get(output, [])
    if len(transposes) != 1 or transposes[0].op_type != "Transpose" or _perm(transposes[0]) != HEAD_TRANSPOSE:
        return None
    reshapes = readers.get(transposes[0].output[0], [])
    return [transposes[0], reshapes[0]] if len(reshapes) == 1 and reshapes[0].op_type == "Reshape" else None


def _perm(node: onnx.NodeProto) -> list[int]:
    return next((list(attribute.ints) for attribute in node.attribute if attribute.name == "perm"), [])


def _drop_unused(graph: onnx.GraphProto) -> None:
    """Remove the nodes and initializers nothing reads any more (the replaced masks and reshapes)."""
    needed = {output.name for output in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    initializers = [tensor for tensor in graph.initializer if tensor.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
