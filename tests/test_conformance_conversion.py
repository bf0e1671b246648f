"""The converter takes what transformers loads and runs: a GPT-2 whose bos/eos ids lie outside its small vocabulary
(as in transformers' own tiny test models) converts both ways with a warning where transformers warns, and the
converted model computes and generates what the source does.
"""

import json

import torch
from conftest import TOLERANCE
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from vaswani import VaswaniDecoderConfig, VaswaniForCausalLM
from vaswani.conversion.checkpoints import convert_checkpoint
from vaswani.modeling import configuration_shared

VOCAB, FAR_ID = 99, 50256  # GPT2Config's default bos/eos, far outside the tiny vocabulary


def test_gpt2_with_bos_and_eos_outside_the_vocabulary_converts_both_ways(tmp_path):
    torch.manual_seed(0)
    source = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)).eval()
    assert source.config.bos_token_id == source.config.eos_token_id == FAR_ID
    source.save_pretrained(tmp_path / "gpt2")
    vaswani_folder = convert_checkpoint(tmp_path / "gpt2", tmp_path / "vaswani")
    back_folder = convert_checkpoint(vaswani_folder, tmp_path / "back", reverse="gpt2")
    assert json.loads((vaswani_folder / "config.json").read_text())["eos_token_id"] == FAR_ID
    converted = VaswaniForCausalLM.from_pretrained(vaswani_folder).eval()
    back = AutoModelForCausalLM.from_pretrained(back_folder).eval()
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        expected = source(prompt).logits
        for model in (converted, back):
            assert (model(prompt).logits - expected).abs().max().item() <= TOLERANCE
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected_tokens = source.generate(prompt, **greedy).tolist()
    assert converted.generate(prompt, **greedy).tolist() == back.generate(prompt, **greedy).tolist() == expected_tokens


def test_bos_or_eos_outside_the_vocabulary_warns_where_transformers_warns():
    for name in ("bos_token_id", "eos_token_id"):
        with CaptureLogger(logging.get_logger("transformers.configuration_utils")) as transformers_log:
            GPT2Config(vocab_size=VOCAB, **{name: VOCAB + 7}).validate()
        with CaptureLogger(configuration_shared.logger) as vaswani_log:
            config = VaswaniDecoderConfig(vocab_size=VOCAB, **{name: VOCAB + 7})
        assert f"{VOCAB + 7}" in transformers_log.out, "the oracle: transformers warns"
        assert f"{name}={VOCAB + 7}" in vaswani_log.out and "outside the vocabulary" in vaswani_log.out
        assert getattr(config, name) == VOCAB + 7
