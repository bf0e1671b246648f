"""Continuous batching: the engine thread that decodes every running sequence in one batch, one token per step.

A submitted sequence waits in a bounded queue (`QueueFull` past it: the server answers 429), is prefilled apart from
the running batch, together with the other waiting prompts that fit (`engine.PrefillGroup`, at most
`max_prefill_tokens` padded tokens), joins the running batch at the next step and leaves it as soon as it finishes or
its client goes away, without waiting for the others (`engine.RunningBatch`). While sequences are running, the
prompts are fed in chunks, one chunk between two decoding steps, so that joining prompts delay the running sequences
by one chunk's time per step instead of by their whole prefill; a chunk holds `prefill_chunk` tokens times the
number of joining prompts per running sequence (rounded up), so that a burst of new requests is not fed a few tokens
per step beside one running sequence. With nothing running, the prompts are prefilled in one call, as offline
`generate` prefills a batch.

Tokens are chosen per row by `sampling.choose_tokens`: greedy (argmax, as `generate`'s greedy search) or sampled as
`generate` samples, from the row's own random generator (its `seed`), so rows never influence each other's tokens; a
row whose choice fails ends alone, with an error event, and the others go on.

Each new token is handed to the sequence's `emit` callback on the engine thread; the server's callback moves it to
its asyncio loop. ONNX Runtime releases the GIL while a step runs, so the event loop serves HTTP meanwhile.

    >>> engine = Engine(OrtStepModel(model), max_batch=16)
    >>> engine.start()
    >>> engine.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.0), emit=print)
"""

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .engine import PrefillGroup, RunningBatch
from .sampling import RowSampler, SamplingParams, TokenChoice, TokenLogprobs
from .sampling import choose_tokens as choose_row_tokens

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More sequences are waiting than the engine was configured to hold."""


@dataclass
class Event:
    """What the engine tells a sequence's owner: a new `token`, and with the last one the `finish_reason` ("stop":
    an end-of-sequence token, "length": `max_tokens` or the context reached, "error": see `error`), and the token's
    `logprobs` where the sequence asked for them."""

    token: int | None
    finish_reason: str | None = None
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # with `SamplingParams.logprobs` set


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    id: int = 0
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False

    def __post_init__(self) -> None:
        self.sampler = RowSampler(self.prompt, self.params)

    @property
    def position(self) -> int:
        """The position of the next token fed to the model: every token so far."""
        return len(self.prompt) + len(self.generated) - 1


class Engine:
    """Runs a step model over a continuously changing batch of sequences, on a thread of its own.

    Args:
        model: an `OrtStepModel` or `TorchStepModel`.
        max_batch: sequences decoded together at most; more wait.
        max_waiting: sequences waiting at most; `submit` raises `QueueFull` past it.
        prefill_chunk: prompt tokens (over all prompts of a group) fed between two decoding steps while sequences
            are running, times the group's rows per running sequence (rounded up); at least one column.
        max_prefill_tokens: padded prompt tokens prefilled together at most (a longer prompt is prefilled alone).
    """

    def __init__(
        self, model, max_batch: int = 16, max_waiting: int = 64, prefill_chunk: int = 32, max_prefill_tokens: int = 2048
    ):
        if max_batch < 1 or max_waiting < 0 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be at least 1 and max_waiting at least 0.")
        self.model = model
        self.max_batch, self.max_waiting, self.prefill_chunk = max_batch, max_waiting, prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: PrefillGroup | None = None
        self.batch = RunningBatch()
        self.wakeup = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.steps = 0  # decoding steps so far, for /health and tests
        # Seconds spent in each part of the loop, for /health and the benchmark: the graph's calls (prefill, decode)
        # against the batching work around them (join: merging prefilled rows in; leave: dropping rows, trimming).
        self.seconds = dict.fromkeys(("prefill", "decode", "join", "leave", "sampling"), 0.0)

    # -- the API the server calls, from any thread

    def submit(self, prompt: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Sequence:
        """Queue a sequence; its tokens go to `emit` (called on the engine thread). Raises `QueueFull`."""
        sequence = Sequence(list(prompt), params, emit, id=next(self.ids))
        with self.wakeup:
            if len(self.waiting) >= self.max_waiting + max(0, self.max_batch - self.busy):
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the limit is {self.max_waiting}).")
            self.waiting.append(sequence)
            self.wakeup.notify()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop `sequence` (its client left, or a stop string was found): its row is freed before the next step."""
        sequence.cancelled = True

    @property
    def busy(self) -> int:
        """Sequences holding a slot: running or being prefilled."""
        return len(self.batch) + (len(self.prefilling.rows) if self.prefilling else 0)

    def stats(self) -> dict[str, Any]:
        prefilling = len(self.prefilling.rows) if self.prefilling else 0
        seconds = {part: round(value, 4) for part, value in self.seconds.items()}
        return {"running": len(self.batch), "prefilling": prefilling, "waiting": len(self.waiting), "seconds": seconds}

    def start(self) -> "Engine":
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="vaswani-engine", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join(timeout=10)

    # -- the engine thread

    def _loop(self) -> None:
        while True:
            with self.wakeup:
                while not self.stopping and not (self.waiting or self.prefilling or self.batch.rows):
                    self.wakeup.wait()
                if self.stopping:
                    return
                if self.prefilling is None and self.waiting and self.busy < self.max_batch:
                    self.prefilling = self._next_group()
            try:
                self._iteration()
            except Exception as error:  # a failing step must not take the server down: fail its sequences
                log.exception("decoding step failed")
                self._fail_all(f"{type(error).__name__}: {error}")

    def _next_group(self) -> PrefillGroup:
        """The waiting sequences that fit in the free slots and in `max_prefill_tokens` (the first always does)."""
        group = [self.waiting.popleft()]
        longest = len(group[0].prompt)
        while self.waiting and self.busy + len(group) < self.max_batch:
            longer = max(longest, len(self.waiting[0].prompt))
            if longer * (len(group) + 1) > self.max_prefill_tokens:
                break
            group.append(self.waiting.popleft())
            longest = longer
        return PrefillGroup(group, [sequence.prompt for sequence in group], self.model.empty_cache(len(group)))

    def _iteration(self) -> None:
        self._drop_cancelled_waiting()
        group = self.prefilling
        if group is not None:
            if all(sequence.cancelled for sequence in group.rows):
                self.prefilling = None
            else:
                try:
                    self._prefill(group)
                except Exception as error:  # e.g. a prompt the graph rejects: only these requests fail
                    log.exception("prefill failed")
                    self.prefilling = None
                    for sequence in group.rows:
                        self._finish(sequence, Event(None, "error", f"{type(error).__name__}: {error}"))
        if self.batch.rows:
            self._decode_step()

    def _drop_cancelled_waiting(self) -> None:
        if any(sequence.cancelled for sequence in self.waiting):
            with self.wakeup:
                self.waiting = deque(sequence for sequence in self.waiting if not sequence.cancelled)

    def _prefill(self, group: PrefillGroup) -> None:
        """One chunk of the group's prompts (all of them when nothing else runs); after the last chunk, their first
        tokens, and they join the batch."""
        columns = group.ids.shape[1]
        if self.batch.rows:
            # The chunk grows with the number of prompts waiting per running sequence: a burst of new requests
            # beside one running sequence should not trickle in a few tokens per step, a lone newcomer beside a
            # full batch should.
            budget = self.prefill_chunk * -(-len(group.rows) // len(self.batch))
            columns = max(1, budget // len(group.rows))
        with self.timed("prefill"):
            logits = group.run(self.model, columns)
        if not group.done:
            return
        self.prefilling = None
        with self.timed("sampling"):
            tokens = choose_tokens(logits, group.rows)
        self._accept(group.rows, tokens)
        keep = [i for i, sequence in enumerate(group.rows) if not (sequence.finished or sequence.cancelled)]
        with self.timed("join"):
            self.batch.join(*group.keep(keep))

    def _decode_step(self) -> None:
        rows = self.batch.rows
        with self.timed("leave"):
            self.batch.keep([i for i, sequence in enumerate(rows) if not sequence.cancelled])
        rows = self.batch.rows
        if not rows:
            return
        tokens = np.array([[sequence.generated[-1]] for sequence in rows], dtype=np.int64)
        positions = np.array([[sequence.position] for sequence in rows], dtype=np.int64)
        with self.timed("decode"):
            logits = self.batch.step(self.model, tokens, positions)
        self.steps += 1
        with self.timed("sampling"):
            tokens = choose_tokens(logits, rows)
        self._accept(rows, tokens)
        with self.timed("leave"):
            self.batch.keep([i for i, sequence in enumerate(rows) if not sequence.finished])

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start

    def _accept(self, sequences: list[Sequence], choices: list[TokenChoice]) -> None:
        for sequence, choice in zip(sequences, choices):
            if choice.error is not None:  # this sequence alone fails; the others keep their tokens
                self._finish(sequence, Event(None, "error", f"choosing sequence {sequence.id}'s token: {choice.error}"))
                continue
            token = choice.token
            sequence.generated.append(token)
            params = sequence.params
            reason = None
            if token in params.stop_token_ids and not params.ignore_eos:
                reason = "stop"
            elif len(sequence.generated) >= params.max_tokens or sequence.position + 1 >= self.model.context_length:
                reason = "length"
            if reason is None:
                sequence.emit(Event(token, logprobs=choice.logprobs))
            else:
                self._finish(sequence, Event(token, reason, logprobs=choice.logprobs))

    def _finish(self, sequence: Sequence, event: Event) -> None:
        sequence.finished = True
        sequence.emit(event)

    def _fail_all(self, message: str) -> None:
        failed = list(self.batch.rows) + (self.prefilling.rows if self.prefilling else [])
        self.batch.keep([])
        self.prefilling = None
        for sequence in failed:
            if not sequence.finished:
                self._finish(sequence, Event(None, "error", message))


def choose_tokens(logits: np.ndarray, sequences: list[Sequence]) -> list[TokenChoice]:
    """The next token of each row of `logits` (batch, vocab), chosen by its sequence's sampler; a row that fails gets
    its error instead (see `sampling.choose_tokens`)."""
    return choose_row_tokens(logits, [sequence.sampler for sequence in sequences])
