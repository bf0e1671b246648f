"""`vaswani finetune`'s run: the model (full, LoRA or QLoRA), the Trainer, its metrics, and the saved folders."""

import copy
import importlib.util
import logging
import math
import os
import shutil
from functools import partial
from pathlib import Path

import datasets
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    BitsAndBytesConfig,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    DataCollatorWithPadding,
    EvalPrediction,
    TrainerCallback,
    set_seed,
)

from ...data.chat import IGNORE_INDEX
from ...folders import replace_folder
from ..trainer import TrainingProgress, VaswaniTrainer, VaswaniTrainingArguments, save_loss_curve
from .arguments import LORA_TARGET_MODULES, LORA_TASK_TYPES, TASK_MODELS, FinetuneArguments, infer_task, parse_args
from .data import prepare_features

logger = logging.getLogger("vaswani.finetune")


def token_statistics(logits: torch.Tensor | tuple, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Per sequence: summed negative log-likelihood, correct next-token guesses and scored tokens, (batch, 3).

    Reducing logits to three numbers per sequence before the Trainer gathers them keeps evaluation memory small,
    and the unsmoothed likelihood gives the true perplexity even when training uses label smoothing.
    """
    logits = logits[0] if isinstance(logits, tuple) else logits
    if shift:  # a causal LM's logits at position t predict the token at t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    scored = labels != -100
    targets = labels.clamp(min=0)
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    correct = (logits.argmax(-1) == targets) & scored
    return torch.stack([(nll * scored).sum(1), correct.sum(1).float(), scored.sum(1).float()], dim=1)


def token_metrics(prediction: EvalPrediction) -> dict[str, float]:
    nll, correct, count = prediction.predictions.sum(0)
    return {"perplexity": math.exp(nll / count), "token_accuracy": float(correct / count)}


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions == prediction.label_ids).mean())}


# ------------------------------------------------------------------------------------------------------- LoRA


def quantization_config(bits: str) -> BitsAndBytesConfig:
    """bitsandbytes' settings for a frozen base in `bits` ("4bit": NF4 with bf16 compute, as QLoRA; "8bit")."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"--qlora {bits} is not available here: bitsandbytes' {bits} weights need a CUDA GPU, and this machine "
            f"has none. Use --lora, which trains the same adapters on a full-precision base."
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"--qlora {bits} needs bitsandbytes: pip install bitsandbytes.")
    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )  # fmt: skip


def lora_targets(model: torch.nn.Module, requested: str | None) -> list[str]:
    """The linear layer names LoRA adapts: those asked for (all must exist), or the default projections present."""
    linear_names = sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )
    if requested is None:
        targets = [name for name in LORA_TARGET_MODULES if name in linear_names]
        if not targets:
            raise ValueError(
                f"The model has none of LoRA's default target modules ({', '.join(LORA_TARGET_MODULES)}): name its "
                f"linear layers with --lora_target_modules, from {', '.join(linear_names)}."
            )
        return targets
    targets = [name.strip() for name in requested.split(",") if name.strip()]
    unknown = [name for name in targets if name not in linear_names]
    if unknown or not targets:
        raise ValueError(
            f"--lora_target_modules names {', '.join(unknown) or 'nothing'}, which the model has no linear layer "
            f"called; its linear layers are {', '.join(linear_names)}."
        )
    return targets


def add_lora(model: torch.nn.Module, args: FinetuneArguments, task: str, training_args: VaswaniTrainingArguments):
    """`model` wrapped by PEFT with LoRA adapters on `lora_targets`, only they (and a new classification head)
    trainable."""
    try:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    except ImportError as error:
        raise ValueError("--lora needs PEFT: pip install -e '.[train]' (or pip install peft).") from error
    if args.qlora:
        # Casts norms to fp32 and prepares inputs for checkpointing, as a quantized base needs.
        model = prepare_model_for_kbit_training(
            model, training_args.gradient_checkpointing, training_args.gradient_checkpointing_kwargs
        )
    config = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=lora_targets(model, args.lora_target_modules), task_type=LORA_TASK_TYPES[task],
    )  # fmt: skip
    model = get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    if training_args.process_index == 0:
        print(
            f"LoRA (rank {args.lora_r}, alpha {args.lora_alpha:g}) on {', '.join(sorted(config.target_modules))}: "
            f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%)"
        )
    return model


# ------------------------------------------------------------------------------------------------------- main


def save_final_model(trainer: VaswaniTrainer, output_dir: Path, merge: bool = False) -> Path:
    """The trained model and tokenizer to `output_dir/model`, written beside it first and then renamed into place,
    with the loss curve. With `merge` (LoRA), the adapter goes to `output_dir/adapter` and `model/` gets the plain
    model with the adapter merged into its weights."""
    final = output_dir / "model"
    if merge:
        save_folder(trainer, output_dir / "adapter")
        final_staging = output_dir / ".model.partial"
        if trainer.is_world_process_zero():
            shutil.rmtree(final_staging, ignore_errors=True)
            # W + (alpha / r) B A into each adapted layer; the PEFT wrappers go. (Training and evaluation are over.)
            merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
            merged.save_pretrained(final_staging)
            trainer.processing_class.save_pretrained(final_staging)
            write_loss_curve(trainer, final_staging, final)
            replace_folder(final_staging, final)
        trainer.accelerator.wait_for_everyone()
        return final
    return save_folder(trainer, final)


def save_folder(trainer: VaswaniTrainer, final: Path) -> Path:
    """`trainer.save_model` (the model, or a PEFT model's adapter alone, and the tokenizer) to `final`, atomically."""
    staging = final.parent / f".{final.name}.partial"
    if trainer.is_world_process_zero() and staging.exists():
        shutil.rmtree(staging)  # left by an interrupted run
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))  # on every process: FSDP gathers the shards; only the main process writes
    if trainer.is_world_process_zero():
        write_loss_curve(trainer, staging, final)
        replace_folder(staging, final)
    trainer.accelerator.wait_for_everyone()
    return final


def write_loss_curve(trainer: VaswaniTrainer, staging: Path, final: Path) -> None:
    title = f"fine-tuning {Path(trainer.args.output_dir).name}"
    if save_loss_curve(trainer.state.log_history, staging / "loss_curve.png", title=title) is not None:
        print(f"loss curve: {final / 'loss_curve.png'}")


def finetune(argv: list[str] | None = None, callbacks: list[TrainerCallback] | None = None) -> dict:
    """Fine-tune and/or evaluate as the command line `argv` says (`vaswani finetune --help`; None: `sys.argv`);
    return the metrics and the Trainer's log history. `callbacks` are added to the Trainer's.

    Example:
        >>> from vaswani.training.finetuning import finetune
        >>> results = finetune(["--model", "my-decoder", "--train_file", "train.txt", "--output_dir", "out"])  # doctest: +SKIP
        >>> results["model_dir"]  # doctest: +SKIP
        'out/model'

    Returns:
        `{"task": ..., "train": train metrics, "eval": final eval metrics, "log_history": [...], "model_dir": ...}`
        (`train`/`model_dir` only with `--train_file`, `eval` only with `--validation_file`).
    """
    args, training_args = parse_args(argv)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size != launched:
        raise ValueError(
            f"{launched} processes were launched, but they did not join one process group (no GPU here?): add "
            f"--use_cpu to train on CPU processes over gloo."
        )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log_level = training_args.get_process_log_level()  # only the main process logs at info level
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    config = AutoConfig.from_pretrained(args.model)
    task = args.task or infer_task(config, args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The main process prepares the data first and caches it; the others then read its cache.
    with training_args.main_process_first(desc="loading and tokenizing the data"):
        features, model_overrides = prepare_features(task, args, config, tokenizer)

    set_seed(training_args.seed)  # a new classification head starts from the same weights on every process
    if model_overrides:
        logger.info("A new classification head with %d classes is initialized.", model_overrides["num_labels"])
    if args.qlora:
        model_overrides["quantization_config"] = quantization_config(args.qlora)
    try:
        model = TASK_MODELS[task].from_pretrained(
            args.model, **model_overrides, ignore_mismatched_sizes="num_labels" in model_overrides
        )
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise ValueError(
            f"{args.model} is a {config.model_type} model, which has no {task} form: pick another --task."
        ) from error
    if args.lora:
        model = add_lora(model, args, task, training_args)
    if training_args.include_num_input_tokens_seen in ("no", False):
        training_args.include_num_input_tokens_seen = "non_padding"  # for the tokens/s that TrainingProgress shows

    if task == "sequence-classification":
        collator, compute_metrics, reduce_logits = DataCollatorWithPadding(tokenizer), accuracy, _argmax
    else:
        if args.packing:
            collator = DataCollatorWithFlattening(separator_id=IGNORE_INDEX)
        else:  # pads input ids and, with -100, labels: blocks and conversations of unequal lengths batch together
            # on the right: a decoder's default positions count from its first token, padding included. (A copy: the
            # saved tokenizer keeps its own side, which batched generation relies on.)
            padding_tokenizer = copy.deepcopy(tokenizer)
            padding_tokenizer.padding_side = "right"
            collator = DataCollatorForSeq2Seq(padding_tokenizer, model=model if task == "seq2seq" else None)
        compute_metrics = token_metrics
        reduce_logits = partial(token_statistics, shift=task == "causal-lm")
    trainer = VaswaniTrainer(
        model=model,
        args=training_args,
        data_collator=collator,
        train_dataset=features.get("train"),
        eval_dataset=features.get("validation"),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=reduce_logits,
        callbacks=[TrainingProgress(), *(callbacks or [])],
    )
    fsdp_requested = bool(training_args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and not trainer.is_fsdp_enabled:
        # accelerate turns FSDP on only for GPU (and other accelerator) process groups; CPU processes would silently
        # train with plain DDP instead.
        raise ValueError(
            "FSDP was requested, but accelerate runs CPU processes (--use_cpu, or no GPU) as plain DDP: launch on "
            "GPUs, or use docs/accelerate/ddp_cpu.yaml for CPU processes."
        )

    results: dict = {"task": task}
    if "train" in features:
        resume = training_args.resume_from_checkpoint
        if resume is not None and resume.lower() in ("true", "last"):
            resume = True  # --resume_from_checkpoint last: the newest checkpoint in --output_dir
        train_output = trainer.train(resume_from_checkpoint=resume)
        results["train"] = train_output.metrics
        trainer.log_metrics("train", train_output.metrics)
        trainer.save_metrics("train", train_output.metrics)
    if "validation" in features:
        results["eval"] = trainer.evaluate()
        trainer.log_metrics("eval", results["eval"])
        trainer.save_metrics("eval", results["eval"])
    if "train" in features:  # saved after the last evaluation, so the loss curve ends with it (and --merge may unwrap)
        results["model_dir"] = str(save_final_model(trainer, Path(training_args.output_dir), merge=args.merge))
    results["log_history"] = list(trainer.state.log_history)
    return results


def _argmax(logits: torch.Tensor | tuple, labels: torch.Tensor) -> torch.Tensor:
    return (logits[0] if isinstance(logits, tuple) else logits).argmax(-1)
