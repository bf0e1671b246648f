"""Fine-tuning with `vaswani finetune` and the paper's recipe in `vaswani.training`.

`vaswani.training.finetuning.finetune(argv)` (what the command runs, returning its metrics) and the command itself
(`vaswani.cli.main.main(["finetune", ...])`) run in-process; tests/test_distributed.py launches it under torchrun and
accelerate. Models are tiny, saved with a tiny tokenizer trained on the packaged corpus; the data files are written
from that corpus.
The paper's schedule is checked against its formula written out here and against transformers' `inverse_sqrt`.
"""

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, TrainerCallback
from transformers.optimization import get_inverse_sqrt_schedule

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForSequenceClassification
from vaswani.cli.main import main as vaswani
from vaswani.data import corpus_stories
from vaswani.data.tokenization import corpus_tokenizer
from vaswani.training import VaswaniTrainer, VaswaniTrainingArguments, get_paper_schedule
from vaswani.training.finetuning import finetune
from vaswani.training.finetuning.data import label_mapping

# Flags every run shares (a test's own flags come after and win): CPU, quiet, no checkpoints, 32-token blocks.
COMMON = "--use_cpu --disable_tqdm true --report_to none --max_length 32 --save_strategy no --logging_steps 1"


def make_workspace(root: Path) -> Path:
    """Three tiny saved models (causal LM, encoder classifier, seq2seq) with a 300-token tokenizer, and data files:
    corpus stories as text (causal LM) and corpus sentences as JSON lines with a class (`speech` if the sentence
    quotes someone, else `narration`) and a target (the sentence's words in reverse order)."""
    tokenizer = corpus_tokenizer(vocab_size=300, kilobytes=50)
    special = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    generation = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    models = {
        "decoder": VaswaniForCausalLM(tiny_decoder_config(**special, **generation)),
        "encoder": VaswaniForSequenceClassification(tiny_encoder_config(**special, num_labels=2)),
        "seq2seq": VaswaniForConditionalGeneration(
            tiny_seq2seq_config(**special, **generation, decoder_start_token_id=tokenizer.eos_token_id)
        ),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)

    stories = corpus_stories()
    (root / "train.txt").write_text("\n\n".join(stories[:40]))
    (root / "valid.txt").write_text("\n\n".join(stories[800:806]))
    sentences = [s for story in stories[:200] for s in re.split(r"(?<=[.!?]) ", story) if len(s) < 80]
    for name, chunk in (("train", sentences[:512]), ("valid", sentences[-96:])):
        rows = [
            {"text": s, "label": "speech" if '"' in s else "narration", "target": " ".join(reversed(s.split()))}
            for s in chunk
        ]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("finetune"))


def finetune_argv(workspace: Path, output_dir: Path, flags: str) -> list[str]:
    return [*COMMON.split(), *flags.split(), "--output_dir", str(output_dir), "--cache_dir", str(workspace / "cache")]


def eval_losses(results: dict) -> tuple[float, float]:
    """The eval loss before training (`--eval_on_start`) and after it."""
    losses = [entry["eval_loss"] for entry in results["log_history"] if "eval_loss" in entry]
    return losses[0], results["eval"]["eval_loss"]


# --------------------------------------------------------------------------------------- a short fine-tune learns


def test_causal_lm_finetune_lowers_eval_loss(workspace: Path, tmp_path: Path) -> None:
    flags = f"--model {workspace / 'decoder'} --train_file {workspace / 'train.txt'}"
    flags += f" --validation_file {workspace / 'valid.txt'} --eval_on_start --eval_strategy no"
    flags += " --max_steps 30 --per_device_train_batch_size 8 --learning_rate 3e-3 --save_steps 15"
    flags += " --save_strategy steps --drop_last_block"  # equal blocks: the Trainer's mean loss is per token
    results = finetune(finetune_argv(workspace, tmp_path, flags))
    before, after = eval_losses(results)
    assert results["task"] == "causal-lm"
    assert after < before - 1.0, (before, after)
    # Perplexity comes from the metric's own per-token sums; without label smoothing it is exp(Trainer's loss).
    assert results["eval"]["eval_perplexity"] == pytest.approx(math.exp(after), rel=1e-4)
    assert (tmp_path / "checkpoint-15" / "optimizer.pt").is_file()
    saved = VaswaniForCausalLM.from_pretrained(tmp_path / "model")
    start = VaswaniForCausalLM.from_pretrained(workspace / "decoder")
    assert not torch.equal(saved.lm_head.weight, start.lm_head.weight)
    assert (tmp_path / "model" / "tokenizer.json").is_file()
    assert not any(path.name.startswith(".") for path in tmp_path.iterdir())  # no staging folder left behind


def test_sequence_classification_finetune_lowers_eval_loss(workspace: Path, tmp_path: Path) -> None:
    flags = f"--model {workspace / 'encoder'} --train_file {workspace / 'train.jsonl'}"
    flags += f" --validation_file {workspace / 'valid.jsonl'} --eval_on_start --eval_strategy no"
    flags += " --max_steps 30 --per_device_train_batch_size 16 --learning_rate 3e-3"
    results = finetune(finetune_argv(workspace, tmp_path, flags))
    before, after = eval_losses(results)
    assert results["task"] == "sequence-classification"
    assert after < 0.5 * before, (before, after)
    assert results["eval"]["eval_accuracy"] > 0.9
    # String labels are numbered in sorted order and saved with the model.
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "model")
    assert saved.config.id2label == {0: "narration", 1: "speech"}


def test_seq2seq_finetune_lowers_eval_loss(workspace: Path, tmp_path: Path) -> None:
    flags = f"--model {workspace / 'seq2seq'} --train_file {workspace / 'train.jsonl'}"
    flags += f" --validation_file {workspace / 'valid.jsonl'} --eval_on_start --eval_strategy no"
    flags += " --max_steps 30 --per_device_train_batch_size 16 --learning_rate 3e-3"
    results = finetune(finetune_argv(workspace, tmp_path, flags))
    before, after = eval_losses(results)
    assert results["task"] == "seq2seq"
    assert after < before - 1.0, (before, after)
    # Targets vary in length: the Trainer's loss averages per-batch means, the perplexity is per token over all.
    assert results["eval"]["eval_perplexity"] == pytest.approx(math.exp(after), rel=0.01)
    first_eval = next(entry for entry in results["log_history"] if "eval_loss" in entry)
    assert results["eval"]["eval_token_accuracy"] > first_eval["eval_token_accuracy"]


def test_new_head_on_a_decoder_with_the_paper_recipe(workspace: Path, tmp_path: Path) -> None:
    """A pretrained causal LM gets a classification head (`--task`), trained with the paper's schedule and label
    smoothing. (tests/test_distributed.py runs the script as a command, under `accelerate launch`.)"""
    flags = f"--model {workspace / 'decoder'} --task sequence-classification --train_file {workspace / 'train.jsonl'}"
    flags += f" --validation_file {workspace / 'valid.jsonl'} --eval_on_start --eval_strategy no --max_steps 30"
    flags += (
        " --per_device_train_batch_size 16 --lr_scheduler_type paper --warmup_steps 10 --label_smoothing_factor 0.1"
    )
    results = finetune(finetune_argv(workspace, tmp_path, flags))
    before, after = eval_losses(results)
    assert after < 0.5 * before, (before, after)
    evals = json.loads((tmp_path / "eval_results.json").read_text())
    assert evals["eval_accuracy"] == results["eval"]["eval_accuracy"] > 0.9
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["architectures"] == ["VaswaniDecoderForSequenceClassification"]
    assert saved["label2id"] == {"narration": 0, "speech": 1}


# ------------------------------------------------------------------------------------------------------- resuming


class RecordResumedState(TrainerCallback):
    """What the Trainer holds when training (re)starts: its step, optimizer state and scheduler state."""

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs) -> None:
        self.global_step = state.global_step
        # Copies: the state dicts hold the live tensors, which training goes on to update in place.
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())
        self.scheduler_state = copy.deepcopy(lr_scheduler.state_dict())


def test_resuming_from_a_checkpoint_continues_the_same_run(workspace: Path, tmp_path: Path) -> None:
    flags = f"--model {workspace / 'decoder'} --train_file {workspace / 'train.txt'} --max_steps 6"
    flags += " --per_device_train_batch_size 8 --save_strategy steps --save_steps 3 --seed 7"
    flags += " --lr_scheduler_type paper --warmup_steps 4 --learning_rate 2 --label_smoothing_factor 0.1"
    whole = finetune(finetune_argv(workspace, tmp_path / "whole", flags))
    checkpoint = tmp_path / "whole" / "checkpoint-3"

    recorder = RecordResumedState()
    resumed_flags = f"{flags} --resume_from_checkpoint {checkpoint}"
    resumed = finetune(finetune_argv(workspace, tmp_path / "resumed", resumed_flags), callbacks=[recorder])

    assert recorder.global_step == 3
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(recorder.optimizer_state["state"]) == len(saved["state"]) > 0
    for index, tensors in saved["state"].items():
        for name, value in tensors.items():
            torch.testing.assert_close(recorder.optimizer_state["state"][index][name], value, rtol=0, atol=0)
    assert recorder.scheduler_state["last_epoch"] == 3

    # Steps 4 to 6 again: the same losses (same data order and weights) and the same scheduled rates.
    def after_checkpoint(run: dict) -> list[float]:
        entries = [entry for entry in run["log_history"] if "loss" in entry and entry["step"] > 3]
        return [value for entry in entries for value in (entry["loss"], entry["learning_rate"])]

    assert len(after_checkpoint(whole)) == 6
    assert after_checkpoint(resumed) == pytest.approx(after_checkpoint(whole), rel=1e-6)
    final_whole = load_file(tmp_path / "whole" / "model" / "model.safetensors")
    final_resumed = load_file(tmp_path / "resumed" / "model" / "model.safetensors")
    for name, value in final_whole.items():
        torch.testing.assert_close(final_resumed[name], value, rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------------------- the paper's recipe


def paper_rate(step_num: int, d_model: int, warmup_steps: int) -> float:
    """Section 5.3 of the paper, written out: lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup^-1.5)."""
    return d_model**-0.5 * min(step_num**-0.5, step_num * warmup_steps**-1.5)


def rates_of_updates(schedule_of, base_lr: float, updates: int) -> list[float]:
    """The learning rate each of the first `updates` optimizer steps uses, as `Trainer` drives a schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    schedule = schedule_of(optimizer)
    rates = []
    for _ in range(updates):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def test_paper_schedule_follows_the_formula() -> None:
    rates = rates_of_updates(lambda optimizer: get_paper_schedule(optimizer, 512, 4000), 1.0, 12000)
    expected = [paper_rate(n, 512, 4000) for n in range(1, 12001)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert max(rates) == pytest.approx((512 * 4000) ** -0.5) == rates[3999]  # the peak, at the end of warmup


def test_paper_schedule_is_transformers_inverse_sqrt_one_step_ahead() -> None:
    """transformers' `inverse_sqrt` with the paper's peak as learning rate gives update n the paper's rate for n - 1
    (its first update uses 0)."""
    d_model, warmup = 64, 10
    ours = rates_of_updates(lambda optimizer: get_paper_schedule(optimizer, d_model, warmup), 1.0, 50)
    theirs = rates_of_updates(
        lambda optimizer: get_inverse_sqrt_schedule(optimizer, warmup), (d_model * warmup) ** -0.5, 51
    )
    assert theirs[0] == 0.0
    assert ours == pytest.approx(theirs[1:], rel=1e-12)


def test_paper_recipe_in_trainer(workspace: Path, tmp_path: Path) -> None:
    """`lr_scheduler_type="paper"`: the Trainer's updates follow the formula for the model's d_model, with Adam(0.9,
    0.98, 1e-9); other schedules keep transformers' defaults."""
    model = VaswaniForCausalLM.from_pretrained(workspace / "decoder")
    batch = {"input_ids": torch.arange(3, 35).repeat(4, 1)}
    batch["labels"] = batch["input_ids"].clone()
    dataset = [{name: tensor[row] for name, tensor in batch.items()} for row in range(4)]
    args = VaswaniTrainingArguments(
        str(tmp_path), lr_scheduler_type="paper", warmup_steps=3, max_steps=8, per_device_train_batch_size=4,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = VaswaniTrainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert logged == pytest.approx([paper_rate(n, model.config.hidden_size, 3) for n in range(1, 9)], rel=1e-9)
    group = trainer.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.9, 0.98), 1e-9, 0.0)
    # A second train() makes the schedule anew for its own length and warmup, as transformers does with its own.
    trainer.args.max_steps, trainer.args.warmup_steps = 4, 2
    trainer.state.log_history.clear()
    trainer.train()
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert logged == pytest.approx([paper_rate(n, model.config.hidden_size, 2) for n in range(1, 5)], rel=1e-9)

    plain = VaswaniTrainingArguments(str(tmp_path), lr_scheduler_type="inverse_sqrt")
    assert (plain.learning_rate, plain.adam_beta2, plain.adam_epsilon) == (5e-5, 0.999, 1e-8)
    with pytest.raises(ValueError, match="--warmup_steps"):
        VaswaniTrainingArguments(str(tmp_path), lr_scheduler_type="paper")


def test_label_smoothing_scores_a_causal_lm_against_the_next_token(workspace: Path, tmp_path: Path) -> None:
    """transformers' own Trainer shifts labels for label smoothing only for causal LMs in its registry; ours must
    shift them too. The oracle is PyTorch's label-smoothed cross-entropy on the shifted logits."""
    model = VaswaniForCausalLM.from_pretrained(workspace / "decoder")
    args = VaswaniTrainingArguments(str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to="none")
    trainer = VaswaniTrainer(model=model, args=args)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[0, :4] = -100
    loss = trainer.compute_loss(model, {"input_ids": input_ids, "labels": labels.clone()})
    logits = model(input_ids).logits
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), label_smoothing=0.1
    )
    torch.testing.assert_close(loss, expected)


# ------------------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_named(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = f"--model {workspace / 'decoder'} --output_dir {tmp_path} --use_cpu"
    with pytest.raises(ValueError, match="Nothing to do"):
        finetune(base.split())
    assert vaswani(["finetune", *base.split()]) == 2  # the command: the same message, no traceback
    assert "error: Nothing to do" in capsys.readouterr().err
    (tmp_path / "data.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.jsonl, \.json, \.csv, \.txt"):
        finetune([*base.split(), "--train_file", str(tmp_path / "data.parquet")])
    with pytest.raises(ValueError, match="--task"):
        finetune([*base.split(), "--train_file", str(workspace / "train.txt"), "--task", "translation"])
    with pytest.raises(ValueError, match="no column 'label'"):
        finetune(
            [*base.split(), "--train_file", str(workspace / "train.txt"), "--task", "sequence-classification"]
            + ["--cache_dir", str(workspace / "cache")]
        )
    with pytest.raises(ValueError, match="no causal-lm form"):
        finetune(
            [*base.split(), "--model", str(workspace / "seq2seq"), "--task", "causal-lm"]
            + ["--train_file", str(workspace / "train.txt"), "--cache_dir", str(workspace / "cache")]
        )


def test_class_labels_map_onto_the_saved_head_when_they_fit() -> None:
    config = tiny_encoder_config(num_labels=3, id2label={0: "cat", 1: "dog", 2: "fox"})
    assert label_mapping(config, [0, 2], is_classifier=True) == ({0: 0, 2: 2}, {})
    assert label_mapping(config, [0, 4], is_classifier=True)[1] == {"num_labels": 5}
    assert label_mapping(config, ["fox", "cat"], is_classifier=True) == ({"cat": 0, "dog": 1, "fox": 2}, {})
    label2id, overrides = label_mapping(config, ["owl", "cat"], is_classifier=True)
    assert label2id == {"cat": 0, "owl": 1} and overrides["id2label"] == {0: "cat", 1: "owl"}
    assert label_mapping(config, ["cat", "fox"], is_classifier=False)[1]["num_labels"] == 2
    with pytest.raises(ValueError, match="all integers or all strings"):
        label_mapping(config, [1, "cat"], is_classifier=True)


@pytest.mark.parametrize("model_name", ["encoder", "seq2seq"])
def test_lora_fine_tunes_a_classifier_and_a_seq2seq_model(workspace: Path, tmp_path: Path, model_name: str) -> None:
    """--lora beyond causal LMs: PEFT's task types for classification (the head trains in full, as PEFT's
    `modules_to_save`) and seq2seq; only the adapter is saved. (tests/test_finetune_lora_chat.py covers causal LMs.)"""
    flags = f"--model {workspace / model_name} --train_file {workspace / 'train.jsonl'} --lora --merge"
    flags += f" --validation_file {workspace / 'valid.jsonl'} --eval_on_start --eval_strategy no --max_steps 20"
    flags += " --per_device_train_batch_size 16 --learning_rate 1e-2"
    results = finetune(finetune_argv(workspace, tmp_path, flags))
    before, after = eval_losses(results)
    assert after < before - 0.5, (before, after)
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == {"encoder": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}[model_name]
    merged = json.loads((tmp_path / "model" / "config.json").read_text())
    assert merged["architectures"] == [
        {"encoder": "VaswaniEncoderForSequenceClassification", "seq2seq": "VaswaniForConditionalGeneration"}[model_name]
    ]
