"""The one place where architecture modules are registered: their tables, merged.

To add an architecture, write its module (see `architecture.py` for what it provides) and add it to
`ARCHITECTURE_MODULES`.
"""

from ...modeling import VaswaniPreTrainedModel
from . import bart, bert, gpt2, llama, t5
from .architecture import Architecture

ARCHITECTURE_MODULES = (llama, gpt2, bert, bart, t5)

# model_type -> its mappers, e.g. "llama", "mistral", "qwen2", "gpt2", "bert", "bart", "t5".
ARCHITECTURES: dict[str, Architecture] = {
    name: architecture for module in ARCHITECTURE_MODULES for name, architecture in module.ARCHITECTURES.items()
}

# The source class decides the head: bare stacks map to bare stacks, task heads to the matching vaswani head.
# `to_transformers` reads the table backwards.
TARGET_CLASSES: dict[str, type[VaswaniPreTrainedModel]] = {
    class_name: target for module in ARCHITECTURE_MODULES for class_name, target in module.TARGET_CLASSES.items()
}
