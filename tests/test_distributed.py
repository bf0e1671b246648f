"""Scale-out: `vaswani finetune` runs unchanged under `torchrun` and `accelerate launch` (DDP), and the models shard
per layer under FSDP2.

Two CPU processes (gloo) train a few steps with half the batch each; the oracle is one process training the same
steps on the whole batch (dropout is 0 and the data order is seeded, so the runs differ only in float summation
order). Each launched run takes about 10 to 15 seconds, mostly process start-up.

This file is also the per-rank program of the launched runs (`python tests/test_distributed.py MODE ...`, see
`worker`): it runs `vaswani.training.finetuning.finetune` with a callback that saves each rank's final weights, or the FSDP2 loop.

FSDP through the Trainer needs GPUs: accelerate 1.15 turns FSDP on only for accelerator process groups (on CPU it
silently trains plain DDP, which `vaswani finetune` refuses). torch's FSDP2 itself runs on gloo, so on CPU the models are
sharded per block with `fully_shard` directly, using the wrap policy accelerate derives from `_no_split_modules`.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from conftest import TOLERANCE, tiny_decoder_config, tiny_encoder_config, tiny_seq2seq_config
from safetensors.torch import load_file, save_file
from test_finetune import finetune, finetune_argv, make_workspace
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import TrainerCallback

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForSequenceClassification
from vaswani.modeling.layers import VaswaniBlock

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = ROOT / "docs" / "accelerate"
STEPS, PER_RANK_BATCH, RANKS = 3, 4, 2
TIMEOUT = 180  # seconds per launched run; a few steps take about 15 s on a loaded 2-core machine
# DDP averages the ranks' gradients; one process sums the same terms in another order.


def launch_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


def run_launched(command: list[str]) -> None:
    completed = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=launch_env(), cwd=ROOT)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def max_abs_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(expected) <= set(actual)
    return max((actual[name] - value).abs().max().item() for name, value in expected.items())


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_workspace(tmp_path_factory.mktemp("distributed"))


def training_flags(workspace: Path, batch_size: int) -> str:
    flags = f"--model {workspace / 'decoder'} --train_file {workspace / 'train.txt'} --max_steps {STEPS}"
    return flags + f" --per_device_train_batch_size {batch_size} --learning_rate 3e-3 --seed 3"


@pytest.fixture(scope="module")
def single_process_weights(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The oracle: one process, the whole global batch."""
    output_dir = tmp_path_factory.mktemp("single")
    finetune(finetune_argv(workspace, output_dir, training_flags(workspace, RANKS * PER_RANK_BATCH)))
    weights = load_file(output_dir / "model" / "model.safetensors")
    start = load_file(workspace / "decoder" / "model.safetensors")
    assert max_abs_diff(weights, start) > 1e-3  # it trained: the comparisons below are not between untouched weights
    return weights


# ------------------------------------------------------------------------------------------------------------- DDP


@pytest.mark.slow  # several processes, each importing torch and training
def test_torchrun_ddp_ranks_agree_with_one_process(
    workspace: Path, tmp_path: Path, single_process_weights: dict[str, torch.Tensor]
) -> None:
    argv = finetune_argv(workspace, tmp_path, training_flags(workspace, PER_RANK_BATCH) + " --ddp_backend gloo")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    run_launched([*torchrun, __file__, "finetune", str(tmp_path), *argv])

    ranks = [load_file(tmp_path / f"rank{rank}.safetensors") for rank in range(RANKS)]
    assert max_abs_diff(ranks[1], ranks[0]) == 0.0
    assert max_abs_diff(ranks[0], single_process_weights) < TOLERANCE
    saved = load_file(tmp_path / "model" / "model.safetensors")  # written once, by the main process
    assert max_abs_diff(ranks[0], saved) == 0.0


@pytest.mark.slow  # several processes, each importing torch and training
def test_accelerate_launch_ddp_matches_one_process(
    workspace: Path, tmp_path: Path, single_process_weights: dict[str, torch.Tensor]
) -> None:
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / "ddp_cpu.yaml"),
    ]
    launch += ["--main_process_port", str(free_port())]
    argv = finetune_argv(workspace, tmp_path, training_flags(workspace, PER_RANK_BATCH))
    run_launched([*launch, "-m", "vaswani", "finetune", *argv])

    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert max_abs_diff(saved, single_process_weights) < TOLERANCE


# ------------------------------------------------------------------------------------------------------------ FSDP


def fsdp_config_wrap_policy(model: torch.nn.Module):
    """The wrap policy accelerate builds for `model` from docs/accelerate/fsdp.yaml."""
    fsdp_config = yaml.safe_load((ACCELERATE_CONFIGS / "fsdp.yaml").read_text())["fsdp_config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_config["fsdp_version"],
        auto_wrap_policy=fsdp_config["fsdp_auto_wrap_policy"].lower(),
        transformer_cls_names_to_wrap=fsdp_config.get("fsdp_transformer_layer_cls_to_wrap"),
    )
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


@pytest.mark.parametrize("family", ["decoder", "encoder", "seq2seq"])
def test_fsdp_config_wraps_each_block(family: str) -> None:
    model = {
        "decoder": lambda: VaswaniForCausalLM(tiny_decoder_config()),
        "encoder": lambda: VaswaniForSequenceClassification(tiny_encoder_config()),
        "seq2seq": lambda: VaswaniForConditionalGeneration(tiny_seq2seq_config()),
    }[family]()
    policy = fsdp_config_wrap_policy(model)
    wrapped = [module for module in model.modules() if policy(module)]
    blocks = [module for module in model.modules() if isinstance(module, VaswaniBlock)]
    assert wrapped == blocks and len(blocks) == model.config.num_hidden_layers * (2 if family == "seq2seq" else 1)


def fsdp_batches(vocab_size: int) -> torch.Tensor:
    """(steps, global batch, tokens) token ids, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (STEPS, RANKS * PER_RANK_BATCH, 16), generator=generator)


def train_steps(model: torch.nn.Module, batches: torch.Tensor) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for input_ids in batches:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow  # several processes, each importing torch and training
def test_fsdp2_per_block_sharding_on_gloo_matches_one_process(workspace: Path, tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    run_launched([*torchrun, __file__, "fsdp2", str(workspace / "decoder"), str(tmp_path / "sharded.safetensors")])

    model = VaswaniForCausalLM.from_pretrained(workspace / "decoder")
    train_steps(model, fsdp_batches(model.config.vocab_size))
    sharded = load_file(tmp_path / "sharded.safetensors")
    assert max_abs_diff(sharded, {name: value.detach() for name, value in model.state_dict().items()}) < TOLERANCE


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="FSDP through accelerate and the Trainer needs 2 GPUs")
def test_accelerate_launch_fsdp_matches_one_process(
    workspace: Path, tmp_path: Path, single_process_weights: dict[str, torch.Tensor]
) -> None:
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / "fsdp.yaml"),
    ]
    launch += ["--num_processes", str(RANKS), "--main_process_port", str(free_port())]
    argv = finetune_argv(workspace, tmp_path, training_flags(workspace, PER_RANK_BATCH))
    argv.remove("--use_cpu")
    run_launched([*launch, "-m", "vaswani", "finetune", *argv])

    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert max_abs_diff(saved, single_process_weights) < 1e-4  # GPU kernels against the CPU oracle


# ---------------------------------------------------------------------------------------- the launched programs


class SaveRankWeights(TrainerCallback):
    """Each process writes its final weights to `rank<N>.safetensors`."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_end(self, args, state, control, model=None, **kwargs) -> None:
        weights = {name: value.detach().clone().contiguous() for name, value in model.state_dict().items()}
        save_file(weights, self.directory / f"rank{args.process_index}.safetensors")


def fsdp2_worker(model_dir: str, output_file: str) -> None:
    """Shard every block, then the root, as accelerate's FSDP2 preparation does; train on this rank's share of each
    batch; gather the full weights on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = VaswaniForCausalLM.from_pretrained(model_dir)
    policy = fsdp_config_wrap_policy(model)
    for module in [module for module in model.modules() if policy(module)]:
        fully_shard(module)
    fully_shard(model)
    assert all(isinstance(block, FSDPModule) for block in model.model.layers)
    batches = fsdp_batches(model.config.vocab_size)
    train_steps(model, batches[:, rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH])
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_file({name: value.clone().contiguous() for name, value in weights.items()}, output_file)
    dist.destroy_process_group()


def worker(argv: list[str]) -> None:
    mode, *rest = argv
    if mode == "finetune":
        directory, *finetune_args = rest
        finetune(finetune_args, callbacks=[SaveRankWeights(directory)])
    elif mode == "fsdp2":
        fsdp2_worker(*rest)
    else:
        raise ValueError(f"Unknown mode {mode!r}: use finetune or fsdp2.")


if __name__ == "__main__":
    worker(sys.argv[1:])
    # The work is done and written. Interpreter finalization after a gloo process group aborts now and then, in a
    # native thread with no Python frame ("terminate called without an active exception", SIGABRT: 2 of 21 fsdp2
    # runs on a 2-core machine; pytorch/pytorch#179291 describes gloo threads outliving the interpreter), so the
    # worker leaves without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
