"""LoRA, chat data, packing, data-sized blocks and training progress in `vaswani finetune` (and `vaswani.data.chat`).

Oracles: transformers' own assistant-token mask (`apply_chat_template(return_assistant_tokens_mask=True)`, from the
template's `generation` block) for the chat labels; a padded evaluation for packing; PEFT's `PeftModel` (base +
adapter) and the LoRA formula W + (alpha / r) B A for the merged model; a run without gradient checkpointing for the
runs with it; the tokenizer's own token count for the block sizes.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoTokenizer, TrainerCallback

from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
from vaswani.data import chat_demo, corpus_stories
from vaswani.data.chat import IGNORE_INDEX, assistant_character_spans, chat_example, chat_tokenizer
from vaswani.training.finetuning import finetune

COMMON = "--use_cpu --disable_tqdm true --report_to none --save_strategy no --logging_steps 1 --seed 0"
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaMA-shaped vaswani chat model (RoPE, gated feed-forward, GQA) with a ChatML tokenizer, conversations
    in the messages format, and two small text files."""
    root = tmp_path_factory.mktemp("lora_chat")
    tokenizer = chat_tokenizer(corpus_stories()[:150], vocab_size=300, model_max_length=256)
    config = VaswaniDecoderConfig.from_preset(
        "llama", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256, initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    VaswaniForCausalLM(config).save_pretrained(root / "chat")
    tokenizer.save_pretrained(root / "chat")
    chat_demo.write_conversations(root / "chats.jsonl", 24)
    chat_demo.write_conversations(root / "chats-valid.jsonl", 8, offset=24)
    (root / "small.txt").write_text("\n\n".join(corpus_stories()[:2]))  # about 1.5 KB
    (root / "tiny.txt").write_text("Once upon a time, there was a cat.\n\nThe end.")
    return root


def run(workspace: Path, output_dir: Path, flags: str, callbacks: list | None = None) -> dict:
    argv = [*COMMON.split(), *flags.split(), "--output_dir", str(output_dir), "--cache_dir", str(workspace / "cache")]
    return finetune(argv, callbacks=callbacks)


class Capture(TrainerCallback):
    """The training set when training starts and the model when it ends."""

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs) -> None:
        self.train_dataset = train_dataloader.dataset

    def on_train_end(self, args, state, control, model=None, **kwargs) -> None:
        self.model = model


def conversations(workspace: Path, name: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in (workspace / name).read_text().splitlines()]


# ------------------------------------------------------------------------------------------------------ chat data


def test_chat_labels_are_the_assistant_tokens_only(workspace: Path) -> None:
    """Token by token: labels equal the input ids exactly where transformers' assistant mask is 1, else -100; and
    each labelled run decodes to that assistant turn's content followed by the end-of-turn marker."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat")
    for messages in conversations(workspace, "chats.jsonl")[:6]:
        example = chat_example(tokenizer, messages)
        oracle = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        assert example["input_ids"] == oracle["input_ids"]
        assert sum(oracle["assistant_masks"]) > 0
        expected = [
            token if mask else IGNORE_INDEX for token, mask in zip(oracle["input_ids"], oracle["assistant_masks"])
        ]
        assert example["labels"] == expected

        runs, current = [], []
        for token, label in zip(example["input_ids"], example["labels"]):
            if label != IGNORE_INDEX:
                current.append(token)
            elif current:
                runs, current = [*runs, current], []
        runs += [current] if current else []
        replies = [message["content"] + "<|im_end|>\n" for message in messages if message["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in runs] == replies


def test_chat_data_errors_name_the_problem(workspace: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat")
    with pytest.raises(ValueError, match="no assistant message"):
        chat_example(tokenizer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="role"):
        chat_example(tokenizer, [{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "Hi"}])
    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    tokenizer.chat_template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix-stable"):
        assistant_character_spans(tokenizer, reply)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat_example(tokenizer, reply)


def oracle_assistant_perplexity(workspace: Path, name: str) -> float:
    """exp(mean next-token NLL over the assistant tokens), each conversation run alone, labels from transformers'
    assistant mask."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat")
    model = VaswaniForCausalLM.from_pretrained(workspace / "chat").eval()
    total, count = 0.0, 0
    for messages in conversations(workspace, name):
        oracle = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        input_ids = torch.tensor([oracle["input_ids"]])
        scored = torch.tensor(oracle["assistant_masks"][1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids).logits[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="none")
        total, count = total + nll[scored].sum().item(), count + int(scored.sum())
    return math.exp(total / count)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_chat_evaluation_scores_the_assistant_tokens(workspace: Path, tmp_path: Path, packing: bool) -> None:
    """The script's perplexity on a conversations file is the assistant tokens' perplexity, whether batches are padded
    or packed into one row (packing must keep each conversation's attention to itself)."""
    flags = f"--model {workspace / 'chat'} --validation_file {workspace / 'chats-valid.jsonl'}"
    flags += " --per_device_eval_batch_size 4" + (" --packing" if packing else "")
    results = run(workspace, tmp_path, flags)
    assert results["eval"]["eval_perplexity"] == pytest.approx(
        oracle_assistant_perplexity(workspace, "chats-valid.jsonl"), rel=1e-4
    )


# ------------------------------------------------------------------------------------------------------------ LoRA


def lora_run(workspace: Path, output_dir: Path, extra: str = "", callbacks: list | None = None) -> dict:
    flags = f"--model {workspace / 'chat'} --train_file {workspace / 'chats.jsonl'} --lora --lora_r 4 --lora_alpha 8"
    flags += " --max_steps 4 --per_device_train_batch_size 4 --learning_rate 1e-2 --lora_dropout 0 " + extra
    return run(workspace, output_dir, flags, callbacks)


def test_lora_trains_only_the_adapter_and_saves_it_alone(workspace: Path, tmp_path: Path) -> None:
    capture = Capture()
    results = lora_run(workspace, tmp_path, callbacks=[capture])
    base = VaswaniForCausalLM.from_pretrained(workspace / "chat")
    rank = 4
    linear = {name: module for name, module in base.named_modules() if name.rsplit(".", 1)[-1] in ADAPTED}
    assert len(linear) == 7 * base.config.num_hidden_layers
    expected_trainable = sum(rank * (module.in_features + module.out_features) for module in linear.values())
    trained = capture.model
    assert trained.get_nb_trainable_parameters()[0] == expected_trainable
    assert {name for name, parameter in trained.named_parameters() if parameter.requires_grad} == {
        name for name, _ in trained.named_parameters() if ".lora_A." in name or ".lora_B." in name
    }
    # Every base weight is exactly as loaded; the adapters moved (B starts at zero).
    trained_state = trained.get_base_model().state_dict()
    for name, value in base.state_dict().items():
        key = name if name in trained_state else name.replace(".weight", ".base_layer.weight")
        assert torch.equal(trained_state[key], value), name
    assert all(parameter.abs().max() > 0 for name, parameter in trained.named_parameters() if ".lora_B." in name)

    saved = sorted(path.name for path in (tmp_path / "model").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    assert {"loss_curve.png", "tokenizer.json", "chat_template.jinja"} <= set(saved)
    reloaded = PeftModel.from_pretrained(VaswaniForCausalLM.from_pretrained(workspace / "chat"), tmp_path / "model")
    input_ids = torch.tensor(
        [
            chat_example(
                AutoTokenizer.from_pretrained(workspace / "chat"), conversations(workspace, "chats-valid.jsonl")[0]
            )["input_ids"]
        ]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded.eval()(input_ids).logits, trained.eval()(input_ids).logits, rtol=0, atol=1e-6
        )

    # Progress: every train log has its perplexity and tokens/s; the curve is a PNG beside the model.
    logs = [entry for entry in results["log_history"] if "loss" in entry]
    assert len(logs) == 4
    for entry in logs:
        assert entry["perplexity"] == pytest.approx(math.exp(entry["loss"]))
        assert entry["tokens_per_second"] > 0
    assert (tmp_path / "model" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merged_model_equals_base_plus_adapter(workspace: Path, tmp_path: Path) -> None:
    lora_run(workspace, tmp_path, "--merge")
    merged = VaswaniForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert not any("lora" in name for name in load_file(tmp_path / "model" / "model.safetensors"))
    base = VaswaniForCausalLM.from_pretrained(workspace / "chat")
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    input_ids = torch.tensor(
        [
            chat_example(
                AutoTokenizer.from_pretrained(tmp_path / "model"), conversations(workspace, "chats-valid.jsonl")[0]
            )["input_ids"]
        ]
    )
    with torch.no_grad():
        difference = (merged(input_ids).logits - with_adapter(input_ids).logits).abs().max().item()
    assert difference <= 1e-5

    # One layer by the formula: W + (alpha / r) B A.
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    prefix = next(key for key in adapter if key.endswith("layers.0.self_attn.q_proj.lora_A.weight"))[
        : -len("lora_A.weight")
    ]
    original = VaswaniForCausalLM.from_pretrained(workspace / "chat").model.layers[0].self_attn.q_proj.weight
    update = (8 / 4) * adapter[prefix + "lora_B.weight"] @ adapter[prefix + "lora_A.weight"]
    assert update.abs().max() > 0
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, original + update, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def adapter_without_checkpointing(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    output_dir = tmp_path_factory.mktemp("no_checkpointing")
    lora_run(workspace, output_dir)
    return load_file(output_dir / "model" / "adapter_model.safetensors")


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_lora_with_gradient_checkpointing_trains_the_same_adapter(
    workspace: Path, tmp_path: Path, adapter_without_checkpointing: dict, use_reentrant: bool
) -> None:
    """Recomputing the activations changes nothing: the adapter after 4 steps equals the one trained without
    checkpointing. (Reentrant checkpointing passes no gradient to LoRA unless the inputs require grad.)"""
    kwargs = json.dumps({"use_reentrant": use_reentrant}).replace(" ", "")
    lora_run(workspace, tmp_path, f"--gradient_checkpointing --gradient_checkpointing_kwargs {kwargs}")
    adapter = load_file(tmp_path / "model" / "adapter_model.safetensors")
    assert adapter.keys() == adapter_without_checkpointing.keys()
    for name, value in adapter_without_checkpointing.items():
        torch.testing.assert_close(adapter[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_flags_are_checked(workspace: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--lora_target_modules names c_attn"):
        lora_run(workspace, tmp_path, "--lora_target_modules q_proj,c_attn")
    with pytest.raises(ValueError, match="add --lora"):
        run(workspace, tmp_path, f"--model {workspace / 'chat'} --train_file {workspace / 'chats.jsonl'} --merge")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where no CUDA GPU is present")
def test_qlora_on_cpu_says_it_is_not_available(workspace: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--qlora 4bit is not available here.*--lora"):
        run(workspace, tmp_path, f"--model {workspace / 'chat'} --train_file {workspace / 'chats.jsonl'} --qlora 4bit")


# ---------------------------------------------------------------------------------------------- data of any size


def text_tokens(workspace: Path, name: str) -> int:
    """The file's tokens as the script streams them: each paragraph's tokens and end-of-text."""
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat")
    paragraphs = [p.strip() for p in (workspace / name).read_text().split("\n\n") if p.strip()]
    return sum(len(tokenizer(p, add_special_tokens=False).input_ids) + 1 for p in paragraphs)


@pytest.mark.parametrize("drop_last_block", [False, True], ids=["keep-last", "drop-last"])
def test_a_small_text_file_trains_in_model_sized_blocks(workspace: Path, tmp_path: Path, drop_last_block: bool) -> None:
    """About 1.5 KB of text and no --max_length: blocks of the model's 256 positions, the last partial one kept
    (or dropped on request)."""
    capture = Capture()
    flags = f"--model {workspace / 'chat'} --train_file {workspace / 'small.txt'} --max_steps 1"
    flags += " --drop_last_block" if drop_last_block else ""
    run(workspace, tmp_path, flags, callbacks=[capture])
    total = text_tokens(workspace, "small.txt")
    assert total > 2 * 256 and total % 256
    lengths = [len(row["input_ids"]) for row in capture.train_dataset]
    expected = [256] * (total // 256) + ([] if drop_last_block else [total % 256])
    assert lengths == expected


def test_text_shorter_than_the_model_is_one_block_of_its_own_length(workspace: Path, tmp_path: Path) -> None:
    capture = Capture()
    run(
        workspace,
        tmp_path,
        f"--model {workspace / 'chat'} --train_file {workspace / 'tiny.txt'} --max_steps 1",
        [capture],
    )
    assert [len(row["input_ids"]) for row in capture.train_dataset] == [text_tokens(workspace, "tiny.txt")]
    with pytest.raises(ValueError, match="fewer tokens than --max_length"):
        run(
            workspace,
            tmp_path / "dropped",
            f"--model {workspace / 'chat'} --train_file {workspace / 'tiny.txt'} --max_length 100 --drop_last_block",
        )


def test_conversations_default_to_the_longest_one(workspace: Path, tmp_path: Path) -> None:
    capture = Capture()
    run(
        workspace,
        tmp_path,
        f"--model {workspace / 'chat'} --train_file {workspace / 'chats.jsonl'} --max_steps 1",
        [capture],
    )
    tokenizer = AutoTokenizer.from_pretrained(workspace / "chat")
    lengths = [
        len(tokenizer.apply_chat_template(messages)["input_ids"])
        for messages in conversations(workspace, "chats.jsonl")
    ]
    expected = [min(length, 256) for length in lengths]
    assert [len(row["input_ids"]) for row in capture.train_dataset] == expected


def test_a_resumed_lora_run_ends_with_the_uninterrupted_runs_adapter(workspace: Path, tmp_path: Path) -> None:
    """Checkpoints of a LoRA run hold the adapter and optimizer state; resuming from one continues the same run."""
    checkpointing = "--save_strategy steps --save_steps 2 --max_steps 4"
    lora_run(workspace, tmp_path / "whole", checkpointing)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    lora_run(workspace, tmp_path / "resumed", f"{checkpointing} --resume_from_checkpoint {checkpoint}")
    whole = load_file(tmp_path / "whole" / "model" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model" / "adapter_model.safetensors")
    assert whole.keys() == resumed.keys()
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)
