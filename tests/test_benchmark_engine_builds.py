"""benchmarks/benchmark_engines.py's build recipes: each vaswani system's name, through its recipe, becomes the
`vaswani export` flags the name promises (block size, attention form). A wrong parse builds another export under the
system's name and the page measures it silently. Nothing is built or timed: the build command is captured."""

import argparse
from pathlib import Path

import pytest

from benchmarks import benchmark_engines

EXPECTED_FLAGS = {
    "vaswani ORT int8": ["--quantize", "int8"],
    "vaswani ORT int8, portable": ["--quantize", "int8", "--attention", "portable"],
    "vaswani ORT int8, --block-size 128": ["--quantize", "int8", "--block-size", "128"],
    "vaswani ORT int8, --block-size 128, portable, --engine openvino": [
        "--quantize", "int8", "--block-size", "128", "--attention", "portable",
    ],
    "vaswani ORT int4, --block-size 64": ["--quantize", "int4", "--block-size", "64"],
    "vaswani ORT int4, --block-size 64 --int4-head-bits 4 --int4-8bit-budget 0.05": [
        "--quantize", "int4", "--block-size", "64", "--int4-head-bits", "4", "--int4-8bit-budget", "0.05",
    ],
    "vaswani ORT int4, --block-size 64 --int4-head-bits 4 --int4-8bit-budget 0.05, portable, --engine openvino": [
        "--quantize", "int4", "--block-size", "64", "--int4-head-bits", "4", "--int4-8bit-budget", "0.05",
        "--attention", "portable",
    ],
    "vaswani ORT fp32, GQA": ["--attention", "gqa"],
}  # fmt: skip


@pytest.mark.parametrize("system", sorted(EXPECTED_FLAGS))
def test_a_vaswani_systems_export_takes_the_flags_its_name_gives(system: str, tmp_path: Path, monkeypatch):
    commands = []
    recipe = benchmark_engines.SYSTEMS[system][2]
    monkeypatch.setattr(benchmark_engines, "run_logged", lambda command, log, label: commands.append(command) or 0.0)
    (tmp_path / "vaswani").mkdir()
    (tmp_path / "vaswani" / ".built").touch()  # the converted source folder every export starts from, built already
    (tmp_path / recipe).mkdir()
    args = argparse.Namespace(model=tmp_path / "hf", work_dir=tmp_path, fresh=False, seq2seq=False, tolerance=None)
    assert system in benchmark_engines.DECODER_SYSTEMS
    benchmark_engines.build(recipe, args, {})
    export = [str(part) for part in commands[-1]]
    assert export[1] == "export" and export[export.index("--output") + 1] == str(tmp_path / recipe)
    flags = export[export.index("--overwrite") + 1 :]
    assert flags == EXPECTED_FLAGS[system]
