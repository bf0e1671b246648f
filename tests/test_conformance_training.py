"""Training behaviours that transformers' own models have and its tooling relies on: gradient checkpointing in both
modes (PEFT's `prepare_model_for_kbit_training` uses the reentrant one), for every family and position type.

The oracle is the same model trained without checkpointing: checkpointing only trades memory for recomputation, so
the loss and every gradient must come out the same.
"""

import pytest
import torch
from conftest import (
    POSITION_TYPES,
    build_model,
    random_ids,
    tiny_decoder_config,
    tiny_encoder_config,
    tiny_seq2seq_config,
)

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForMaskedLM

FAMILIES = {
    "decoder": (VaswaniForCausalLM, tiny_decoder_config),
    "encoder": (VaswaniForMaskedLM, tiny_encoder_config),
    "seq2seq": (VaswaniForConditionalGeneration, tiny_seq2seq_config),
}


def loss_and_gradients(model: torch.nn.Module, batch: dict, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both runs (checkpointing replays the RNG state)
    loss = model(**batch).loss
    loss.backward()
    gradients = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    return loss.detach(), gradients


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_matches_training_without_it(family, position_embedding_type, use_reentrant):
    model_class, make_config = FAMILIES[family]
    config = make_config(position_embedding_type=position_embedding_type, hidden_dropout=0.1, attention_dropout=0.1)
    model = build_model(model_class, config).train()
    ids = random_ids(2, 7)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    batch["attention_mask"][1, 5:] = 0  # padding too, so the masks reach the checkpointed layers

    expected_loss, expected_gradients = loss_and_gradients(model, batch, seed=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.modules() if hasattr(layer, "_gradient_checkpointing_func"))
    loss, gradients = loss_and_gradients(model, batch, seed=1)

    torch.testing.assert_close(loss, expected_loss)
    assert gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], msg=lambda message, name=name: f"{name}: {message}")
    # The learned position bias and the encoder (through cross-attention) must receive their gradients.
    if position_embedding_type == "relative_bias":
        assert any("relative_attention_bias" in name for name in gradients)
    if family == "seq2seq":
        assert any(name.startswith("model.encoder.layers") for name in gradients)
