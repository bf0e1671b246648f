"""The supported transformers range is enforced where a wrong version would corrupt results silently."""

import subprocess
import sys


def test_importing_with_transformers_5_24_or_newer_fails_with_the_fix():
    # transformers 5.24's generate passes the cache as `cache=`, which these models would not see: without the guard
    # they generate wrong tokens with no error. Fake the version in a fresh interpreter and import the models.
    code = "import transformers; transformers.__version__ = '5.24.0'; import vaswani"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "transformers>=5,<5.24" in result.stderr

