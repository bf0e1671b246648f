"""What every architecture module provides, and the helpers they share.

An architecture module (`llama.py`, `gpt2.py`, ...) maps one transformers architecture both ways: its config
(`config_from_*`, `config_to_*`) and its weight names (a `Renames` table read by `rename_weights` in either
direction, plus whatever reshaping the architecture needs). It lists what it provides in `ARCHITECTURES`
(`model_type` -> `Architecture`) and `TARGET_CLASSES` (transformers class name -> vaswani class); `registry.py`
collects them.
"""

import dataclasses
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedConfig

from ...modeling import VaswaniConfig

StateDict = dict[str, torch.Tensor]
# (transformers name prefix, vaswani name prefix): one weight's two names, read left to right when converting from
# transformers and right to left when converting back. `{placeholders}` (see PLACEHOLDERS) stand for the parts both
# names share, such as a layer index. A `None` vaswani name drops the tensor: transformers keeps it twice.
Renames = Sequence[tuple[str, str | None]]
PLACEHOLDERS = {"layer": r"\d+", "side": "encoder|decoder", "qkv": "[qkv]", "qkvo": "[qkvo]", "mlp": "gate|up|down"}


@cache
def _prefix_pattern(template: str) -> re.Pattern:
    """`"h.{layer}.ln_1."` -> a regular expression matching names that begin with it, capturing the placeholders."""
    pieces = re.split(r"\{(\w+)\}", template)  # literal text and placeholder names, alternately
    return re.compile(
        "".join(
            re.escape(piece) if i % 2 == 0 else f"(?P<{piece}>{PLACEHOLDERS[piece]})" for i, piece in enumerate(pieces)
        )
    )


def rename_weights(state_dict: StateDict, renames: Renames, architecture: str, *, reverse: bool = False) -> StateDict:
    """Rename every tensor by the first pair whose source prefix its name begins with (transformers -> vaswani, or
    vaswani -> transformers when `reverse`); drop it where the pair's target is `None`.

    A name that no pair matches is an error: a checkpoint variant the mapper does not know fails here, by name,
    instead of loading partially.
    """
    pairs = [(ours, theirs) for theirs, ours in renames if ours is not None] if reverse else list(renames)
    converted, unknown = {}, []
    for name, tensor in state_dict.items():
        for source, target in pairs:
            if match := _prefix_pattern(source).match(name):
                if target is not None:
                    converted[target.format(**match.groupdict()) + name[match.end() :]] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        if reverse:
            raise ValueError(f"No {architecture} weight corresponds to the vaswani weights {unknown}.")
        raise ValueError(f"No {architecture} weight mapping for {unknown}: this checkpoint variant is not supported.")
    return converted


def special_token_ids(config: PreTrainedConfig) -> dict:
    return {name: getattr(config, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}


# Every config carries the special token ids (as attributes when its class does not declare them).
SPECIAL_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def transformers_config(config_class: type[PreTrainedConfig], **values: Any) -> PreTrainedConfig:
    """`config_class(**values)`, leaving out what the class does not declare.

    transformers stores an undeclared keyword as an attribute that its model then ignores; left out, the field reads
    back as the class's own value, so `check_convertible` reports it instead of the conversion dropping it silently.
    """
    declared = {field.name for field in dataclasses.fields(config_class)}
    return config_class(
        **{name: value for name, value in values.items() if name in declared or name in SPECIAL_TOKEN_FIELDS}
    )


class Architecture(NamedTuple):
    """One transformers architecture's mappers, each way."""

    family: type[VaswaniConfig]  # the vaswani config family this architecture maps to
    config_from: Callable[[PreTrainedConfig], VaswaniConfig]
    state_dict_from: Callable[[StateDict], StateDict]
    config_to: Callable[[VaswaniConfig], PreTrainedConfig]
    state_dict_to: Callable[[StateDict, VaswaniConfig], StateDict]
