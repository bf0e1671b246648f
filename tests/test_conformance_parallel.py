"""Tensor parallelism as for transformers' own Llama: every family has a plan (`model.tp_plan`) that splits attention
by heads and the feed-forward by its width, and its LM head; the plan names real modules only; and a model loaded with
`tp_plan="auto"` on two CPU processes (gloo) computes the logits of the unsharded model.

Models with position biases (ALiBi, relative bias) keep attention whole (the bias covers all heads at once).

This file is also the per-rank program of the launched run (`python tests/test_conformance_parallel.py OUT FOLDER...`).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    POSITION_TYPES,
    TOLERANCE,
    build_model,
    random_ids,
    tiny_decoder_config,
    tiny_encoder_config,
    tiny_seq2seq_config,
)
from test_conversion_parity import tiny_decoder
from transformers import LlamaForCausalLM

from vaswani import VaswaniForCausalLM, VaswaniForConditionalGeneration, VaswaniForMaskedLM, VaswaniPreTrainedModel
from vaswani.conversion.checkpoints import from_transformers

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {
    "decoder": (VaswaniForCausalLM, lambda kind: tiny_decoder_config(position_embedding_type=kind, gated_ffn=True)),
    "encoder": (VaswaniForMaskedLM, lambda kind: tiny_encoder_config(position_embedding_type=kind)),
    "seq2seq": (VaswaniForConditionalGeneration, lambda kind: tiny_seq2seq_config(position_embedding_type=kind)),
}
BIASED = ("alibi", "relative_bias")


def planned_modules(model: VaswaniPreTrainedModel) -> dict[str, str]:
    """Module name -> parallel style, for every module a rule of `model.tp_plan` matches."""
    rules = [(re.compile(re.escape(rule).replace(r"\*", r"\d+") + "$"), style) for rule, style in model.tp_plan.items()]
    return {name: style for name, _ in model.named_modules() for pattern, style in rules if pattern.match(name)}


@pytest.mark.parametrize("position_embedding_type", POSITION_TYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp_plan_splits_every_projection_and_names_only_real_modules(family, position_embedding_type):
    model_class, make_config = FAMILIES[family]
    model = build_model(model_class, make_config(position_embedding_type))
    planned = planned_modules(model)
    patterns = {rule: re.escape(rule).replace(r"\*", r"\d+") for rule in model.tp_plan}
    rules_used = {rule for rule, pattern in patterns.items() if any(re.fullmatch(pattern, name) for name in planned)}
    assert rules_used == set(model.tp_plan), f"rules matching no module: {set(model.tp_plan) - rules_used}"
    assert planned["lm_head"] == "colwise_gather_output"
    for name, _ in model.named_modules():
        if re.search(r"\.mlp\.(gate|up|down)_proj$", name):
            assert planned[name] == ("rowwise" if name.endswith("down_proj") else "colwise"), name
        elif re.search(r"_attn\.[qkvo]_proj$", name):
            expected = None if position_embedding_type in BIASED else "rowwise" if name.endswith("o_proj") else "colwise"
            assert planned.get(name) == expected, name


def test_tp_plan_of_a_converted_llama_is_llamas_plan():
    reference = tiny_decoder(LlamaForCausalLM)
    converted = from_transformers(reference)
    # The module names are the same in both (q_proj, ..., down_proj, lm_head), so the plans must be too. Llama's
    # plan splits the token embedding from transformers 5.21 on; ours does on every release (the style exists there).
    ours, llamas = planned_modules(converted), planned_modules(reference)
    if "model.embed_tokens" not in llamas:
        assert ours.pop("model.embed_tokens") == "embedding_rowwise"
    assert ours == llamas


LAUNCHED = {
    "decoder-rope-tied": (VaswaniForCausalLM, tiny_decoder_config(gated_ffn=True, hidden_act="silu")),
    "encoder-learned": (VaswaniForMaskedLM, tiny_encoder_config()),
    "seq2seq-rope": (VaswaniForConditionalGeneration, tiny_seq2seq_config(position_embedding_type="rope")),
    "seq2seq-relative_bias": (
        VaswaniForConditionalGeneration,
        tiny_seq2seq_config(position_embedding_type="relative_bias"),
    ),
}


def forward_logits(model: VaswaniPreTrainedModel) -> torch.Tensor:
    ids = random_ids(2, 6)
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(ids, decoder_input_ids=ids.flip(-1)).logits
        return model(ids).logits


def test_tensor_parallel_model_computes_the_unsharded_logits(tmp_path):
    expected = {}
    for name, (model_class, config) in LAUNCHED.items():
        model = build_model(model_class, config, attn_implementation="sdpa")
        model.save_pretrained(tmp_path / name)
        expected[name] = forward_logits(model)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    folders = [str(tmp_path / name) for name in LAUNCHED]
    completed = subprocess.run(
        [*torchrun, __file__, str(tmp_path / "out"), *folders],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PATH": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    for rank in range(2):
        actual = torch.load(tmp_path / "out" / f"rank{rank}.pt")
        for name in LAUNCHED:
            assert actual[name]["tp_size"] == 2
            assert (actual[name]["logits"] - expected[name]).abs().max().item() <= TOLERANCE, (name, rank)


def sharded_logits(folder: str) -> dict:
    """One folder loaded with `tp_plan="auto"` on this rank: its tensor-parallel size and logits. The sharded model
    is local, so it is freed on return."""
    classes = {"vaswani_decoder": VaswaniForCausalLM, "vaswani_encoder": VaswaniForMaskedLM}
    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    model_class = classes.get(model_type, VaswaniForConditionalGeneration)
    model = model_class.from_pretrained(folder, tp_plan="auto", attn_implementation="sdpa").eval()
    return {"tp_size": model.tp_size, "logits": forward_logits(model)}


def worker(output_dir: str, folders: list[str]) -> None:
    """Per rank: load every folder with `tp_plan="auto"` and save its logits.

    Teardown order: the sharded models' parameters hold the device mesh and through it the gloo process group. The
    last model used to live until interpreter exit, after `destroy_process_group`, so gloo objects were destroyed
    during finalization - the likely source of a rank 1 abort seen once in CI ("terminate called without an active
    exception", after the results were saved). So every model is freed and collected first, then both ranks meet at
    a barrier, then the group goes."""
    import gc

    import torch.distributed as dist

    results = {Path(folder).name: sharded_logits(folder) for folder in folders}
    gc.collect()
    Path(output_dir).mkdir(exist_ok=True)
    torch.save(results, Path(output_dir) / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2:])
