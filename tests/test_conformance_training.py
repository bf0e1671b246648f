"""Training behaviours that transformers' own models have and its tooling relies on: gradient checkpointing in both
modes (PEFT's `prepare_model_for_kbit_training` uses the reentrant one), for every family and position type.

The oracle is the same model trained without checkpointing: checkpointing only trades memory for recomputation, so
the loss and every gradient must come out the same.
"""

import copy

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
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForMaskedLM
from vaswani.conversion.checkpoints import to_transformers
from vaswani.modeling.layers import positions_from_mask

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
    feed_forward_calls = []
    first_feed_forward = next(module for name, module in model.named_modules() if name.endswith("layers.0.mlp"))
    first_feed_forward.register_forward_pre_hook(lambda *_: feed_forward_calls.append(1))
    loss, gradients = loss_and_gradients(model, batch, seed=1)
    assert len(feed_forward_calls) == 2, "a checkpointed block runs its forward again during backward"

    torch.testing.assert_close(loss, expected_loss)
    assert gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(
            gradient, expected_gradients[name], msg=lambda message, name=name: f"{name}: {message}"
        )
    # The learned position bias and the encoder (through cross-attention) must receive their gradients.
    if position_embedding_type == "relative_bias":
        assert any("relative_attention_bias" in name for name in gradients)
    if family == "seq2seq":
        assert any(name.startswith("model.encoder.layers") for name in gradients)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_with_reentrant_checkpointing_trains_like_without(family):
    """The k-bit training recipe (`peft.prepare_model_for_kbit_training`): a frozen base, reentrant checkpointing,
    input embeddings that require grad, LoRA adapters. The adapters get the gradients of a run without checkpointing
    (relative_bias positions: a bias shared by all layers, and for an encoder-decoder the encoder output, cross every
    checkpointed layer)."""
    model_class, make_config = FAMILIES[family]
    task_type = {"decoder": "CAUSAL_LM", "encoder": None, "seq2seq": "SEQ_2_SEQ_LM"}[family]
    ids = random_ids(2, 7)
    batch = {"input_ids": ids, "labels": ids}
    runs = []
    for checkpointing in (False, True):
        model = build_model(model_class, make_config(position_embedding_type="relative_bias"))
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        if checkpointing:  # what prepare_model_for_kbit_training does for a quantized model
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            model.enable_input_require_grads()
        torch.manual_seed(0)
        model = get_peft_model(
            model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=task_type, init_lora_weights=False)
        )
        model.train()
        runs.append(loss_and_gradients(model, batch, seed=1))
    (expected_loss, expected_gradients), (loss, gradients) = runs
    torch.testing.assert_close(loss, expected_loss)
    assert gradients.keys() == expected_gradients.keys() and all("lora_" in name for name in gradients)
    for name, gradient in gradients.items():
        torch.testing.assert_close(
            gradient, expected_gradients[name], msg=lambda message, name=name: f"{name}: {message}"
        )


# ------------------------------------------------------------------------------------ packed sequences (padding-free)

PACKED_LENGTHS = [5, 9, 7, 12]


def llama_shaped_config(position_embedding_type: str):
    """The tiny decoder in LLaMA's shape (RMSNorm, SwiGLU, grouped-query, no biases), so that its rope variant
    converts to transformers' `LlamaForCausalLM` with the same weights."""
    return tiny_decoder_config(
        position_embedding_type=position_embedding_type,
        norm_type="rmsnorm",
        gated_ffn=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        num_key_value_heads=2,
    )


def packed_and_padded_logits(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the real tokens of `PACKED_LENGTHS` sequences, once packed into one row by transformers'
    `DataCollatorWithFlattening` (position ids restart per sequence, no attention mask) and once as a right-padded
    batch; both (tokens, vocab), in the same order."""
    sequences = [random_ids(1, length, seed=index)[0] for index, length in enumerate(PACKED_LENGTHS)]
    packed = DataCollatorWithFlattening()([{"input_ids": sequence.tolist()} for sequence in sequences])
    padded = torch.zeros(len(sequences), max(PACKED_LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, sequence in enumerate(sequences):
        padded[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
    with torch.no_grad():
        # use_cache=False, as the Trainer sets it: transformers detects packing only when no cache is passed.
        packed_logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
        padded_logits = model(input_ids=padded, attention_mask=mask, use_cache=False).logits
    return packed_logits[0].float(), padded_logits[mask.bool()].float()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_packed_sequences_match_the_padded_batch(position_embedding_type, attn_implementation):
    model = build_model(
        VaswaniForCausalLM, tiny_decoder_config(position_embedding_type=position_embedding_type), attn_implementation
    )
    packed, padded = packed_and_padded_logits(model)
    torch.testing.assert_close(packed, padded)


def padded_with_gaps(sequences: list[torch.Tensor], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose rows hold `sequences` with padding scattered between their tokens (as transformers' common tests'
    random attention masks have), and its attention mask."""
    generator = torch.Generator().manual_seed(seed)
    length = max(len(sequence) for sequence in sequences) + 4
    ids, mask = torch.zeros(len(sequences), length, dtype=torch.long), torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        places = torch.randperm(length - 1, generator=generator)[: len(sequence) - 1].sort().values
        places = torch.cat([places, torch.tensor([length - 1])])  # the last token last, as generate needs
        ids[row, places], mask[row, places] = sequence, 1
    return ids, mask


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_padding_between_tokens_does_not_count_as_distance(position_embedding_type, attn_implementation):
    """transformers' padding-free test (`test_*_padding_matches_padding_free_with_position_ids`) pads rows at random
    places and gives position ids that skip the padding; each real token must then see exactly what it sees with the
    sequence packed. ALiBi and relative-bias distances taken from tensor indices counted the padding between two
    tokens (0.03-0.05 off in bf16 there, and far beyond float32 rounding here)."""
    model = build_model(
        VaswaniForCausalLM, tiny_decoder_config(position_embedding_type=position_embedding_type), attn_implementation
    )
    sequences = [random_ids(1, length, seed=index)[0] for index, length in enumerate(PACKED_LENGTHS)]
    ids, mask = padded_with_gaps(sequences)
    position_ids = positions_from_mask(mask, padding_position=0)
    packed = DataCollatorWithFlattening()([{"input_ids": sequence.tolist()} for sequence in sequences])
    with torch.no_grad():
        gapped = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        alone = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
    torch.testing.assert_close(gapped[mask.bool()], alone[0])


def half_precision_disagreement(model: torch.nn.Module, dtype: torch.dtype) -> float:
    """max |packed - padded| in units of the dtype's rounding step at the logits' scale (eps * max |logit|), so that
    models whose logits differ in scale compare fairly: an absolute threshold would call a model with 10x larger
    logits 10x less precise."""
    packed, padded = packed_and_padded_logits(copy.deepcopy(model).to(dtype))
    return ((packed - padded).abs().max() / (torch.finfo(dtype).eps * padded.abs().max())).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_packed_sequences_in_half_precision_agree_with_the_padded_batch_as_llama_does(attn_implementation, dtype):
    """Half-precision kernels round a 9-key row and a 33-key row differently (sdpa's blocked softmax), so packed and
    padded logits may differ by a few rounding steps; the bar is transformers' Llama with the same weights as our
    rope model, measured here. A position path that adds a large-magnitude bias in half precision (absolute key
    positions, which grow along a packed row) fails it."""
    rope_model = build_model(VaswaniForCausalLM, llama_shaped_config("rope"), attn_implementation)
    llama = to_transformers(rope_model)
    llama.config._attn_implementation = attn_implementation
    llama_disagreement = half_precision_disagreement(llama, dtype)
    # A few rounding steps: the slack that kernels with differently blocked reductions need on any CPU.
    bar = 4 * max(llama_disagreement, 1.0)
    for position_embedding_type in POSITION_TYPES:
        model = build_model(VaswaniForCausalLM, llama_shaped_config(position_embedding_type), attn_implementation)
        disagreement = half_precision_disagreement(model, dtype)
        assert disagreement <= bar, (
            f"{position_embedding_type}: packed and padded {dtype} logits differ by {disagreement:.2f} rounding steps, "
            f"Llama's by {llama_disagreement:.2f}"
        )


class PaddingCollator:
    """The padded oracle for the packing collator: right padding, an attention mask, -100 labels on padding."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(feature["input_ids"]) for feature in features)
        batch = {name: torch.zeros(len(features), length, dtype=torch.long) for name in ("input_ids", "attention_mask")}
        batch["labels"] = torch.full((len(features), length), -100)
        for row, feature in enumerate(features):
            ids = torch.tensor(feature["input_ids"])
            batch["input_ids"][row, : len(ids)], batch["attention_mask"][row, : len(ids)] = ids, 1
            batch["labels"][row, : len(ids)] = ids
        return batch


def train_with_collator(model: torch.nn.Module, collator, output_dir) -> tuple[float, dict[str, torch.Tensor]]:
    dataset = [
        {"input_ids": random_ids(1, length, seed=index)[0].tolist()}
        for index, length in enumerate([5, 9, 7, 12, 6, 10, 8, 11])
    ]
    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-2,
        optim="sgd",
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    loss = trainer.train().training_loss
    return loss, {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
def test_trainer_with_packing_collator_trains_like_padded_batches(position_embedding_type, tmp_path):
    """transformers' padding-free recipe: `DataCollatorWithFlattening` with the Trainer gives the same losses and the
    same weights after training as padded batches of the same sequences."""
    config = tiny_decoder_config(position_embedding_type=position_embedding_type, initializer_range=0.02)
    padded_model, packed_model = (build_model(VaswaniForCausalLM, config, "sdpa") for _ in range(2))
    initial_weights = {name: param.detach().clone() for name, param in packed_model.named_parameters()}
    expected_loss, expected_weights = train_with_collator(padded_model, PaddingCollator(), tmp_path / "padded")
    loss, weights = train_with_collator(packed_model, DataCollatorWithFlattening(), tmp_path / "packed")
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for name, weight in weights.items():
        torch.testing.assert_close(weight, expected_weights[name], msg=lambda message, name=name: f"{name}: {message}")
    assert not torch.equal(weights["model.embed_tokens.weight"], initial_weights["model.embed_tokens.weight"])
