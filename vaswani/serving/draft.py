"""Draft-model proposals for the server's speculative decoding (`--speculative-config '{"method": "draft_model",
"model": FOLDER}'`): a smaller export (or PyTorch folder) with the same tokenizer proposes each row's next tokens,
greedily, and the target verifies them in one step (`speculation.Speculator`).

Each sequence gets a one-row batch of the draft's own step model (its kind: per-row lengths or left-padded), made on
its first proposal and dropped with the sequence. Before proposing, the draft's cache is brought in line with the
sequence: the tokens it holds beyond their common prefix (rejected proposals) are given back (`Batch.rollback`), the
sequence's tokens it lacks are fed in one call (`Batch.verify`), then it decodes `room` tokens by argmax. A greedy
proposal is a deterministic function of the text so far, so the acceptance rule for deterministic proposals keeps
sampled rows distributed as plain sampling.

    >>> proposer = DraftProposer(load_draft("smaller-export", provider="cpu", threads=2))
    >>> proposer.propose(sequence, tokens, room=4)
"""

import logging
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class DraftState:
    """One sequence's draft cache: a one-row batch and the tokens it holds."""

    def __init__(self, batch: Any, tokens: list[int]):
        self.batch, self.tokens = batch, tokens


class DraftProposer:
    """Greedy proposals of a draft step model, one cache per sequence (held weakly: a finished sequence's goes)."""

    def __init__(self, step_model: Any):
        self.model = step_model
        self.states: weakref.WeakKeyDictionary[Any, DraftState] = weakref.WeakKeyDictionary()

    def propose(self, sequence: Any, tokens: list[int], room: int) -> list[int]:
        """Up to `room` tokens the draft decodes greedily after `tokens` (the sequence's prompt and answer)."""
        room = min(room, self.model.context_length - len(tokens))
        if room < 1:
            return []
        state = self.states.get(sequence)
        if state is None:
            state = self.states[sequence] = self.start(sequence, tokens[:-1])
        common = 0
        for held, token in zip(state.tokens, tokens):
            if held != token:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is fed below, to get the next one's logits
        if common < len(state.tokens):
            state.batch.rollback([len(state.tokens) - common])
            del state.tokens[common:]
        missing = tokens[common:]
        logits = state.batch.verify([missing])[0][len(missing) - 1]
        state.tokens += missing
        proposals = [int(np.argmax(logits))]
        while len(proposals) < room:
            state.tokens.append(proposals[-1])
            logits = state.batch.step(np.array(proposals[-1:], dtype=np.int64))[0]
            proposals.append(int(np.argmax(logits)))
        return proposals

    def start(self, sequence: Any, tokens: list[int]) -> DraftState:
        """A one-row draft batch holding `tokens` (prefilled in one call)."""
        group = self.model.prefill_group([sequence], [tokens])
        group.run(group.columns)
        batch = self.model.new_batch()
        batch.join(group, [0])
        return DraftState(batch, list(tokens))


def load_draft(folder: str | os.PathLike, provider: str = "cpu", threads: int | None = None) -> Any:
    """The step model of a draft: an exported text-generation folder (its decoder runtime's), or a PyTorch vaswani
    folder (`TorchStepModel`)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"speculative config: the draft model {str(folder)!r} is not a model folder (no config.json); pass an "
            "export (or PyTorch folder) of a smaller model with the same tokenizer."
        )
    if (folder / "manifest.json").is_file():
        from ..runtime import OrtModelForCausalLM, default_session_options

        model = OrtModelForCausalLM.from_pretrained(folder, provider, session_options=default_session_options(threads))
        return model.decoder_runtime.step_model()
    from ..modeling import VaswaniForCausalLM
    from .batches import TorchStepModel

    model = VaswaniForCausalLM.from_pretrained(folder)
    return TorchStepModel(model.to("cuda") if provider == "cuda" else model)
