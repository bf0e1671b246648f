"""`scripts/run_upstream_tests.py` reports a result only when transformers' tests really ran.

A stand-in checkout holds the three modules the runner requires, with mixins that contribute one test each, so the
runner's own paths are exercised in seconds without transformers' repository.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "run_upstream_tests.py"
STUBS = {
    "tests/__init__.py": "",
    "tests/generation/__init__.py": "",
    "tests/generation/test_utils.py": "class GenerationTesterMixin:\n    pass\n",
    "tests/test_configuration_common.py": "class ConfigTester:\n    def __init__(self, *args, **kwargs):\n        pass\n",
    "tests/test_modeling_common.py": (
        "import torch\n\n"
        "def ids_tensor(shape, vocab_size, rng=None, name=None):\n    return torch.randint(0, vocab_size, shape)\n\n"
        "def random_attention_mask(shape, rng=None, name=None):\n    return torch.ones(shape, dtype=torch.long)\n\n"
        "class ModelTesterMixin:\n    def test_stand_in(self):\n        assert self.all_model_classes\n"
    ),
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("transformers")
    for name, text in STUBS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def run(checkout: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--transformers", str(checkout), "--output", str(output), *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_tests_that_ran_give_a_table(checkout, tmp_path):
    result = run(checkout, tmp_path / "table.md", "-k", "stand_in")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in (tmp_path / "table.md").read_text()


def test_a_run_in_which_no_test_ran_is_an_error_not_a_green_table(checkout, tmp_path):
    result = run(checkout, tmp_path / "table.md", "-k", "matches_no_test")
    assert result.returncode != 0
    assert "did not run the tests" in result.stderr or "no test ran" in result.stderr
    assert not (tmp_path / "table.md").exists()
