"""Training vaswani models with transformers' `Trainer`: the paper's recipe (its learning-rate schedule, Adam settings
and label smoothing) as `VaswaniTrainingArguments` + `VaswaniTrainer`, and a small dataset of named tensors.

Example:
    >>> from vaswani.training import VaswaniTrainer, VaswaniTrainingArguments
    >>> args = VaswaniTrainingArguments("out", lr_scheduler_type="paper", warmup_steps=4000, label_smoothing_factor=0.1)
    >>> trainer = VaswaniTrainer(model, args, train_dataset=dataset)  # doctest: +SKIP
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments


class TensorDataset(torch.utils.data.Dataset):
    """Named tensors of equal length, served as the dicts of tensors that `Trainer` feeds to the model.

    Example:
        >>> import torch
        >>> from vaswani.training import TensorDataset
        >>> dataset = TensorDataset(input_ids=torch.zeros(4, 8, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long))
        >>> len(dataset), sorted(dataset[0])
        (4, ['input_ids', 'labels'])
    """

    def __init__(self, **tensors: torch.Tensor) -> None:
        lengths = {name: len(tensor) for name, tensor in tensors.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"TensorDataset needs tensors of one length, got {lengths}.")
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}


# ------------------------------------------------------------------------------------ the paper's training recipe

PAPER_SCHEDULER = "paper"
# Adam as in the paper (section 5.3): beta1 0.9, beta2 0.98, epsilon 1e-9.
PAPER_ADAM_BETA2 = 0.98
PAPER_ADAM_EPSILON = 1e-9


def _paper_multiplier(scheduler_step: int, *, d_model: int, warmup_steps: int) -> float:
    # LambdaLR sets the rate of update n (counted from 1, as the paper's step_num) after n - 1 scheduler steps.
    step_num = scheduler_step + 1
    return d_model**-0.5 * min(step_num**-0.5, step_num * warmup_steps**-1.5)


def get_paper_schedule(
    optimizer: torch.optim.Optimizer, d_model: int, warmup_steps: int, last_epoch: int = -1
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of "Attention Is All You Need" (section 5.3), as a `LambdaLR`:

        lr = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)

    a linear warmup to a peak of (d_model * warmup_steps)^-0.5 at `warmup_steps`, then decay with the inverse square
    root of the step. The optimizer's learning rate multiplies the formula, so an optimizer built with `lr=1.0`
    follows the paper exactly (tensor2tensor calls the multiplier `learning_rate_constant`). The first update uses
    step_num 1.

    transformers' `inverse_sqrt` schedule has the same shape, but its peak is the optimizer's learning rate rather
    than a function of d_model and warmup, and its first update uses a rate of 0 (it is one step behind).

    Example:
        >>> import torch
        >>> from vaswani.training import get_paper_schedule
        >>> optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0, betas=(0.9, 0.98), eps=1e-9)
        >>> schedule = get_paper_schedule(optimizer, d_model=512, warmup_steps=4000)
        >>> f"{optimizer.param_groups[0]['lr']:.3e}"  # the rate of the first update
        '1.747e-07'
    """
    if not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be a positive integer (the model's hidden size), got {d_model!r}.")
    if not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(
            f"The paper's schedule needs warmup_steps >= 1 (the paper used 4000), got {warmup_steps!r}: pass "
            f"--warmup_steps N."
        )
    multiplier = partial(_paper_multiplier, d_model=d_model, warmup_steps=warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier, last_epoch=last_epoch)


@dataclass
class VaswaniTrainingArguments(TrainingArguments):
    """transformers' `TrainingArguments`, plus the paper's learning-rate schedule as `lr_scheduler_type="paper"`.

    With `"paper"`, `learning_rate` multiplies the paper's formula (default 1.0: the paper's rates), Adam defaults to
    the paper's beta2 0.98 and epsilon 1e-9, and `warmup_steps` is required (the paper used 4000). Every other value
    of `lr_scheduler_type` behaves exactly as in transformers, with its defaults (learning rate 5e-5, beta2 0.999,
    epsilon 1e-8). Label smoothing is transformers' `label_smoothing_factor` (the paper used 0.1).

    Example:
        >>> from vaswani.training import VaswaniTrainingArguments
        >>> args = VaswaniTrainingArguments("out", lr_scheduler_type="paper", warmup_steps=4000)
        >>> args.learning_rate, args.adam_beta2, args.adam_epsilon
        (1.0, 0.98, 1e-09)
    """

    lr_scheduler_type: str = field(
        default="linear",
        metadata={
            "help": "transformers' schedules (linear, cosine, inverse_sqrt, ...) or 'paper': the paper's schedule"
        },
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate (default 5e-5); with the paper's schedule, its multiplier (default 1.0)"},
    )
    adam_beta2: float | None = field(
        default=None, metadata={"help": "Adam's beta2 (default 0.999; 0.98 with the paper's schedule)"}
    )
    adam_epsilon: float | None = field(
        default=None, metadata={"help": "Adam's epsilon (default 1e-8; 1e-9 with the paper's schedule)"}
    )
    paper_d_model: int | None = field(
        default=None, metadata={"help": "d_model in the paper's schedule (default: the model's hidden size)"}
    )

    def __post_init__(self) -> None:
        paper = self.lr_scheduler_type == PAPER_SCHEDULER
        defaults = (1.0, PAPER_ADAM_BETA2, PAPER_ADAM_EPSILON) if paper else (5e-5, 0.999, 1e-8)
        for name, default in zip(("learning_rate", "adam_beta2", "adam_epsilon"), defaults):
            if getattr(self, name) is None:
                setattr(self, name, default)
        if paper and not self.warmup_steps:
            raise ValueError(
                "lr_scheduler_type='paper' needs warmup steps (the paper used 4000): pass --warmup_steps N, or a "
                "fraction of the training steps such as --warmup_steps 0.1."
            )
        # transformers validates the name against its own schedules: let it check a stand-in, then restore ours.
        if paper:
            self.lr_scheduler_type = "constant"
        super().__post_init__()
        if paper:
            self.lr_scheduler_type = PAPER_SCHEDULER


class VaswaniTrainer(Trainer):
    """transformers' `Trainer`, plus the paper's schedule (`VaswaniTrainingArguments(lr_scheduler_type="paper")`) and
    label smoothing that shifts a causal LM's labels.

    (transformers' `Trainer` shifts labels for label smoothing only for causal LMs in its own model registry, so with
    a vaswani decoder it would score each token's logits against the token itself instead of the next one.)

    Example:
        >>> trainer = VaswaniTrainer(model, VaswaniTrainingArguments("out", lr_scheduler_type="paper",
        ...     warmup_steps=4000, label_smoothing_factor=0.1), train_dataset=dataset)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paper_schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        if self.label_smoother is not None and self.compute_loss_func is None and _is_causal_lm(self.model):
            self.compute_loss_func = partial(self.label_smoother, shift_labels=True)

    def train(self, *args, **kwargs):
        """transformers' `Trainer.train`. A paper schedule made by an earlier call is made anew, as transformers does
        with its own schedules: its length and warmup may differ this time."""
        if self.lr_scheduler is not None and self.lr_scheduler is self.paper_schedule:
            self.lr_scheduler = self.paper_schedule = None
        return super().train(*args, **kwargs)

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.optim.lr_scheduler.LRScheduler:
        if self.args.lr_scheduler_type != PAPER_SCHEDULER or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        d_model = self.args.paper_d_model or self.accelerator.unwrap_model(self.model).config.hidden_size
        warmup_steps = self.args.get_warmup_steps(num_training_steps)
        self.lr_scheduler = self.paper_schedule = get_paper_schedule(optimizer or self.optimizer, d_model, warmup_steps)
        return self.lr_scheduler


def _is_causal_lm(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(model, "loss_type", None) == "ForCausalLM" and not getattr(config, "is_encoder_decoder", False)


# ------------------------------------------------------------------------------------------- progress and results


class TrainingProgress(TrainerCallback):
    """Shows training as it goes: each logged train loss with its perplexity and the tokens per second since the
    previous log, and each evaluation's loss and perplexity. The same numbers are added to the Trainer's log history
    (`perplexity`, `tokens_per_second`, `eval_perplexity`), so `save_loss_curve` and `trainer_state.json` have them.

    Tokens are counted by the Trainer when `include_num_input_tokens_seen` is on ("non_padding" counts real tokens
    only); otherwise no speed is shown.

    Example:
        >>> args = VaswaniTrainingArguments("out", logging_steps=10, include_num_input_tokens_seen="non_padding")
        >>> trainer = VaswaniTrainer(model, args, train_dataset=dataset, callbacks=[TrainingProgress()])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        step 10/200  loss 3.2145  perplexity 24.88  2,310 tokens/s
    """

    def __init__(self, write: Callable[[str], None] = tqdm.write) -> None:  # tqdm.write keeps progress bars intact
        self.write = write

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.last_time, self.last_tokens = time.perf_counter(), state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        logs = logs or {}
        added: dict[str, float] = {}
        if "loss" in logs:
            added["perplexity"] = _perplexity(logs["loss"])
            now, tokens = time.perf_counter(), state.num_input_tokens_seen
            if args.include_num_input_tokens_seen not in ("no", False) and now > self.last_time:
                added["tokens_per_second"] = round((tokens - self.last_tokens) / (now - self.last_time), 1)
            self.last_time, self.last_tokens = now, tokens
            line = f"step {state.global_step}/{state.max_steps}  loss {logs['loss']:.4f}  perplexity {added['perplexity']:.2f}"
            if "tokens_per_second" in added:
                line += f"  {added['tokens_per_second']:,.0f} tokens/s"
        elif "eval_loss" in logs:
            if "eval_perplexity" not in logs:
                added["eval_perplexity"] = _perplexity(logs["eval_loss"])
            perplexity = logs.get("eval_perplexity", added.get("eval_perplexity"))
            line = f"step {state.global_step}  eval loss {logs['eval_loss']:.4f}  eval perplexity {perplexity:.2f}"
        else:
            return
        logs.update(added)
        if state.log_history:  # the Trainer appended a copy of `logs` just before calling us
            state.log_history[-1].update(added)
        if state.is_world_process_zero:
            self.write(line)


def describe_device(device: torch.device | str = "cpu") -> str:
    """Where numbers were measured, for a results page: "CPU (2 threads), torch 2.13.0+cpu" or the GPU's name.

    Example:
        >>> describe_device(training_args.device)  # doctest: +SKIP
    """
    device = torch.device(device)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"CPU ({threads} thread{'s' if threads > 1 else ''}), torch {torch.__version__}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}, torch {torch.__version__}"


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def save_loss_curve(
    log_history: list[dict],
    path: str | Path,
    title: str = "fine-tuning",
    *,
    chance: float | None = None,
    chance_label: str = "chance",
    log_scale: bool = False,
    accuracy_target: float | None = None,
) -> Path | None:
    """Plot the train loss of every log and the eval losses of `log_history` (a Trainer's `state.log_history`, or
    any list of `{"step", "loss" | "eval_loss" [, "eval_accuracy"]}` dicts) to a PNG at `path`. Returns the path, or
    None (with nothing written) when there is no loss to plot or matplotlib is not installed (`vaswani[train]`).

    `chance` draws a dotted reference loss (e.g. ln(classes), a uniform guess), `log_scale` a logarithmic loss axis;
    when the evaluations carry `eval_accuracy`, a second panel plots it, with `accuracy_target` as a dotted line.

    Example:
        >>> save_loss_curve(trainer.state.log_history, "out/model/loss_curve.png")  # doctest: +SKIP
        >>> save_loss_curve(history, "loss.png", "3 classes", chance=math.log(3), log_scale=True)  # doctest: +SKIP
    """
    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    evals = [(entry["step"], entry["eval_loss"]) for entry in log_history if "eval_loss" in entry]
    accuracies = [(entry["step"], entry["eval_accuracy"]) for entry in log_history if "eval_accuracy" in entry]
    if not train and not evals:
        return None
    try:
        # A Figure of its own, not pyplot: no backend is switched and no global figure state is touched in the
        # caller's process (savefig renders PNG with Agg by itself).
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figure = Figure(figsize=(10 if accuracies else 7, 4))
    axes, *accuracy_axes = figure.subplots(1, 2 if accuracies else 1, squeeze=False)[0]
    if train:
        axes.plot(*zip(*train), label="train loss", linewidth=1, marker="." if len(train) < 30 else None)
    if evals:
        axes.plot(*zip(*evals), label="eval loss", color="C1", marker="o")
    if chance is not None:
        axes.axhline(chance, color="gray", linestyle=":", label=chance_label)
    if log_scale:
        axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.grid(alpha=0.3, which="both")
    axes.legend()
    for accuracy_axis in accuracy_axes:
        accuracy_axis.plot(*zip(*accuracies), "o-", color="C2", markersize=3, label="eval accuracy")
        if accuracy_target is not None:
            accuracy_axis.axhline(accuracy_target, color="gray", linestyle=":", label=f"target {accuracy_target:g}")
        accuracy_axis.set_xlabel("step")
        accuracy_axis.set_ylabel("eval accuracy")
        accuracy_axis.set_ylim(0, 1.02)
        accuracy_axis.grid(alpha=0.3)
        accuracy_axis.legend(loc="lower right")
    if accuracies:
        figure.suptitle(title)
    else:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return Path(path)


__all__ = [
    "PAPER_SCHEDULER",
    "TensorDataset",
    "TrainingProgress",
    "VaswaniTrainer",
    "VaswaniTrainingArguments",
    "describe_device",
    "get_paper_schedule",
    "save_loss_curve",
]
