"""The server's step model for a PyTorch `VaswaniForCausalLM` (`vaswani serve --backend torch`): the one batch kind
serving supplies itself. An exported model's step model comes from its decoder runtime
(`model.decoder_runtime.step_model()`, `vaswani.runtime.decoders`); PyTorch's shares the portable runtime's
left-padded batch (`RunningBatch`, `PrefillGroup`).

    >>> scheduler = Scheduler(TorchStepModel(VaswaniForCausalLM.from_pretrained("folder")))
"""

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from ..modeling import cache_of
from ..runtime.decoders import Batch, Prefill
from ..runtime.decoders.portable import Array, PaddedStepModel, context_length
from ..runtime.generation import store_in_cache

__all__ = ["Batch", "Prefill", "TorchStepModel", "context_length"]


class TorchStepModel(PaddedStepModel):
    """One decoding step of a PyTorch `VaswaniForCausalLM` (as the portable runtime's `OrtStepModel`): the cache arrays
    wrap into a `DynamicCache` without a copy, and the updated one unwraps again. It runs on torch's intra-op threads as the process set them (set once at
    startup; a library that changed them around each step would change them under every other thread)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.context_length = context_length(model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def empty_cache(self, batch: int = 1) -> list[Array]:
        heads = self.config.num_key_value_heads
        head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads
        shape = (batch, heads, 0, head_dim)
        empty = torch.empty(shape, dtype=self.dtype, device=self.device)
        return [empty if self.device.type != "cpu" else empty.numpy()] * (2 * self.config.num_hidden_layers)

    def run(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        positions: np.ndarray,
        past: list[Array],
        logits_to_keep: int = 1,
    ) -> tuple[np.ndarray, list[Array]]:
        cache = DynamicCache(config=self.config)
        if past[0].shape[2]:
            store_in_cache(cache, [torch.as_tensor(tensor, device=self.device) for tensor in past])
        with torch.inference_mode():
            output = self.model(
                input_ids=torch.from_numpy(input_ids).to(self.device),
                attention_mask=torch.from_numpy(attention_mask).to(self.device),
                position_ids=torch.from_numpy(positions).to(self.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        present = [tensor for layer in cache_of(output).layers for tensor in (layer.keys, layer.values)]
        if self.device.type == "cpu":
            present = [tensor.numpy() for tensor in present]
        logits = output.logits[:, -1] if logits_to_keep == 1 else output.logits
        return logits.float().cpu().numpy(), present
