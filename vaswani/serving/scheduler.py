"""Continuous batching: the scheduler thread that decodes every running sequence in one batch, one token per step.

A submitted sequence waits in a bounded queue (`QueueFull` past it: the server answers 429), is prefilled apart from
the running batch, together with the other waiting prompts that fit (a `Prefill` of the step model, at most
`max_prefill_tokens` padded tokens; where the prefill pads nothing and takes prompts while it runs, `extend`, a
prompt arriving meanwhile joins it at once), joins the running batch at the next step (where the step model's prefill
hands over the prompts already in, `take_finished`, as soon as its own prompt is in) and leaves it as soon as it
finishes or its client goes away, without waiting for the others (its `Batch`).

**The token budget** (`max_num_batched_tokens`, vLLM's chunked prefill): each iteration of the loop computes at most
that many tokens: one per running sequence (a decoding step) and, with what is left, a chunk of the prompts being
prefilled. So a long prompt never stalls the running streams for more than one chunk per token, and a burst of new
requests is fed as fast as the budget allows. Each iteration's share is kept in `step_log`. Where the batch takes both
in one call (`step_with_prefill`: OpenVINO's paged batch), the decoding step and the chunk are one call of the graph,
which reads the weights once for both; elsewhere they are two calls.

**The prefix cache** (`prefix_cache`, `prefix_cache.PrefixCache`): a prompt whose first blocks of tokens were seen
before (a shared system prompt, the conversation so far) is prefilled from their cached keys and values and computes
only the rest. Prompts are stored when their prefill ends, and whole sequences when they leave. A waiting prompt that
shares uncached blocks with one already in the group being formed waits for the next group, which finds them cached.

Tokens are chosen per row by `sampling.choose_tokens`: greedy (argmax, as `generate`'s greedy search) or sampled as
`generate` samples, from the row's own random generator (its `seed`), so rows never influence each other's tokens; a
row whose choice fails ends alone, with an error event, and the others go on.

Each new token is handed to the sequence's `emit` callback on the scheduler thread; the server's callback moves it to
its asyncio loop. ONNX Runtime releases the GIL while a step runs, so the event loop serves HTTP meanwhile.

    >>> step_model = model.decoder_runtime.step_model()
    >>> scheduler = Scheduler(step_model, max_batch=16, prefix_cache=PrefixCache.for_model(step_model))
    >>> scheduler.start()
    >>> scheduler.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0.0), emit=print)
"""

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from ..constraints import fill_masks
from .batches import Batch, Prefill
from .prefix_cache import PrefixCache
from .sampling import RowSampler, SamplingParams, TokenChoice, TokenLogprobs
from .sampling import choose_tokens as choose_row_tokens
from .speculation import Speculator

log = logging.getLogger(__name__)

# Tokens computed per iteration at most (decode tokens and a prompt chunk). On a CPU a chunk costs about its tokens'
# share of a full batch's step per token, so the budget is kept to a few decoding steps' worth: a joining prompt
# delays the running streams by at most that, and 256 still feeds a typical chat prompt in one or two iterations.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


class QueueFull(Exception):
    """More sequences are waiting than the scheduler was configured to hold."""


class SchedulerDead(Exception):
    """The scheduler thread is not running (it died, or the scheduler was stopped): nothing submitted would ever run."""


@dataclass
class Event:
    """What the scheduler tells a sequence's owner: a new `token`, and with the last one the `finish_reason` ("stop":
    an end-of-sequence token, "length": `max_tokens` or the context reached, "abort": `Scheduler.cancel`, "error": see
    `error`), and the token's `logprobs` where the sequence asked for them. Every sequence gets exactly one event with a
    finish reason; a token the scheduler thread made while a cancellation was under way may still follow an "abort", and
    owners ignore it."""

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
    # Prompt tokens whose keys and values the prefix cache supplied, set when the sequence joins a prefill group
    # (the answer's `usage.prompt_tokens_details.cached_tokens`).
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.sampler = RowSampler(self.prompt, self.params)

    @property
    def position(self) -> int:
        """The position of the next token fed to the model: every token so far."""
        return len(self.prompt) + len(self.generated) - 1


class Scheduler:
    """Runs a step model over a continuously changing batch of sequences, on a thread of its own.

    Args:
        model: a step model (an export's decoder runtime supplies it, or a `TorchStepModel`): it makes the batch
            (`new_batch`) and the prefill groups (`prefill_group`), and knows `vocab_size` and `context_length`.
        max_batch: sequences decoded together at most; more wait.
        max_waiting: sequences waiting at most; `submit` raises `QueueFull` past it.
        max_num_batched_tokens: tokens computed per iteration at most: a decoding step's (one per running
            sequence) and a chunk of prompts (the rest); at least `max_batch`.
        prefix_cache: where prompt prefixes' keys and values are kept for later prompts (None: nowhere).
        max_prefill_tokens: padded prompt tokens prefilled together at most (a longer prompt is prefilled alone).
    """

    def __init__(
        self,
        model,
        max_batch: int = 16,
        max_waiting: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        prefix_cache: PrefixCache | None = None,
        max_prefill_tokens: int = 2048,
        speculator: Speculator | None = None,
    ):
        if max_batch < 1 or max_waiting < 0:
            raise ValueError("max_batch must be at least 1 and max_waiting at least 0.")
        if max_num_batched_tokens < max_batch:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_batch ({max_batch}): a "
                "decoding step of a full batch computes one token per sequence."
            )
        own_storage = getattr(model, "prefix_storage", None)
        if prefix_cache is not None and own_storage is not None and prefix_cache.storage is not own_storage:
            raise ValueError(
                "This step model shares its own cache blocks with the prefix cache; make the cache with "
                "PrefixCache.for_model(step_model)."
            )
        self.model = model
        self.max_batch, self.max_waiting = max_batch, max_waiting
        self.max_num_batched_tokens, self.prefix_cache = max_num_batched_tokens, prefix_cache
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.prefilling: Prefill | None = None
        self.batch: Batch = model.new_batch()
        self.wakeup = threading.Condition()
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stopping = False
        # Why the scheduler thread ended when nobody stopped it (the watchdog's answer: /health is then 503).
        self.failure: str | None = None
        # Guards `Sequence.finished`: a sequence is finished by the scheduler thread (its last token, an error) or by
        # `cancel` on the server's, and only the first may send the final event.
        self.finishing = threading.Lock()
        # Called on the scheduler thread with the batch size of each decoding step (for /metrics).
        self.step_listeners: list[Callable[[int], None]] = []
        self.steps = 0  # decoding steps so far, for /health and tests
        # Seconds spent in each part of the loop, for /health and the benchmark: the graph's calls (prefill, decode)
        # against the batching work around them (join: merging prefilled rows in; leave: dropping rows, trimming).
        # grammar: waiting for the grammars' masks after the step (they are computed during it).
        # prefix_cache: looking prompts up and storing their blocks.
        self.seconds = dict.fromkeys(("prefill", "decode", "join", "leave", "sampling", "grammar", "prefix_cache"), 0.0)
        # Each iteration's tokens, for tests and the benchmark: (prompt tokens fed, sequences decoded), the latest
        # ones (a prompt's chunk and the decoding step after it share an entry).
        self.step_log: deque[tuple[int, int]] = deque(maxlen=4096)
        self.mask_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vaswani-grammar")
        # Speculative decoding (`speculation`): None decodes one token per row and step.
        self.speculator = speculator

    # -- the API the server calls, from any thread

    def submit(self, prompt: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Sequence:
        """Queue a sequence; its tokens go to `emit` (called on the scheduler thread). Raises `QueueFull`, or
        `SchedulerDead` once the scheduler thread has died or the scheduler was stopped."""
        sequence = Sequence(list(prompt), params, emit, id=next(self.ids))
        with self.wakeup:
            if self.failure is not None or self.stopping:
                raise SchedulerDead(self.failure or "the scheduler is stopping.")
            if len(self.waiting) >= self.max_waiting + max(0, self.max_batch - self.busy):
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the limit is {self.max_waiting}).")
            self.waiting.append(sequence)
            self.wakeup.notify()
        return sequence

    def cancel(self, sequence: Sequence) -> None:
        """Stop `sequence` (its client left, a stop string was found, its time ran out): unless it had finished, it
        ends now with a final `Event(None, "abort")`, and its row is freed before the next step."""
        sequence.cancelled = True
        self._finish(sequence, Event(None, "abort"))

    @property
    def busy(self) -> int:
        """Sequences holding a slot: running or being prefilled."""
        prefilling = self.prefilling  # once: the scheduler thread may clear it between two reads
        return len(self.batch) + (len(prefilling.rows) if prefilling else 0)

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread is running (started, not stopped, not dead)."""
        return self.thread is not None and self.thread.is_alive() and self.failure is None and not self.stopping

    def stats(self) -> dict[str, Any]:
        prefilling_group = self.prefilling  # once, as in `busy`
        prefilling = len(prefilling_group.rows) if prefilling_group else 0
        seconds = {part: round(value, 4) for part, value in self.seconds.items()}
        stats = {"running": len(self.batch), "prefilling": prefilling, "waiting": len(self.waiting), "seconds": seconds}
        if self.prefix_cache is not None:
            stats["prefix_cache"] = self.prefix_cache.stats()
        if self.speculator is not None:
            stats["speculation"] = self.speculator.stats()
        return stats

    def start(self) -> "Scheduler":
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="vaswani-scheduler", daemon=True)
            self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the scheduler thread after its current step; sequences still waiting or running end with an error
        event (the server drains its requests before it stops the scheduler, so normally there are none)."""
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join(timeout=10)
        if self.thread is None or not self.thread.is_alive():
            self._fail_all("the server is shutting down.", waiting=True)
        self.mask_worker.shutdown(wait=False)

    # -- the scheduler thread

    def _run(self) -> None:
        """The thread's body: the loop, and the watchdog's part when it ends unasked (an exception that escaped the
        loop's own handling, e.g. a BaseException): record why, and fail every sequence, waiting ones included, so
        that no request waits for a thread that is gone."""
        reason = "the scheduler thread exited."
        try:
            self._loop()
        except BaseException as error:  # the thread ends here either way; the log keeps the traceback
            reason = f"the scheduler thread died: {type(error).__name__}: {error}"
            log.critical("%s", reason, exc_info=True)
        finally:
            if not self.stopping:
                self.failure = reason
                self._fail_all(reason, waiting=True)

    def _loop(self) -> None:
        while True:
            with self.wakeup:
                while not self.stopping and not (self.waiting or self.prefilling or self.batch.rows):
                    self.wakeup.wait()
                if self.stopping:
                    return
                self._schedule_waiting()
            try:
                self._iteration()
            except Exception as error:  # a failing step must not take the server down: fail its sequences
                log.exception("decoding step failed")
                self._fail_all(f"{type(error).__name__}: {error}")

    def _schedule_waiting(self) -> None:
        """Waiting sequences take the free slots: a new prefill group, or the group being prefilled where it takes
        more prompts while it runs (`_extend_group`)."""
        if self.waiting and self.busy < self.max_batch:
            self._drop_cancelled_waiting()  # a cancelled sequence is never prefilled
            if self.waiting and self.prefilling is None:
                self.prefilling = self._next_group()
            elif self.waiting and hasattr(self.prefilling, "extend"):
                self._extend_group(self.prefilling)

    def _next_group(self) -> Prefill:
        """A group of the waiting sequences that fit in the free slots and in `max_prefill_tokens` (`_admit`)."""
        group, prefixes = self._admit([], self.max_prefill_tokens)
        prompts = [sequence.prompt for sequence in group]
        return self.model.prefill_group(group, prompts, prefixes if any(p is not None for p in prefixes) else None)

    def _extend_group(self, group: Prefill) -> None:
        """Waiting sequences join the group being prefilled, where it takes prompts while it runs (`extend`: the
        paged batch's, which pads nothing, so `max_prefill_tokens` does not bound it): their tokens follow its
        prompts' within the same token budget, as vLLM's and OpenVINO GenAI's schedulers give waiting prompts what
        the budget leaves, rather than waiting for the whole group to end. Every call then feeds the whole budget
        while prompts wait."""
        sequences, prefixes = self._admit(group.rows, None)
        if sequences:
            group.extend(sequences, [sequence.prompt for sequence in sequences], prefixes)

    def _admit(self, members: list[Sequence], max_tokens: int | None) -> tuple[list[Sequence], list[Any]]:
        """The waiting sequences (taken from the queue) that fit beside a group's `members` in the free slots and,
        with `max_tokens`, in that many padded prompt tokens (the first always does), with their cached prefixes
        (None where nothing is cached); one that shares uncached blocks with a member waits for a later group."""
        admitted, prefixes, deferred, longest = [], [], [], 0
        while self.waiting and self.busy + len(admitted) < self.max_batch:
            longer = max(longest, len(self.waiting[0].prompt))
            if max_tokens is not None and admitted and longer * (len(admitted) + 1) > max_tokens:
                break
            sequence = self.waiting.popleft()
            if self.prefix_cache is not None and self.shares_uncached_blocks(sequence, members + admitted):
                deferred.append(sequence)
                continue
            admitted.append(sequence)
            longest = longer
            prefix = None
            if self.prefix_cache is not None:
                with self.timed("prefix_cache"):
                    sequence.cached_tokens, prefix = self.prefix_cache.lookup(sequence.prompt)
            prefixes.append(prefix)
        self.waiting.extendleft(reversed(deferred))
        return admitted, prefixes

    def shares_uncached_blocks(self, sequence: Sequence, group: list[Sequence]) -> bool:
        """Whether `sequence`'s prompt starts with a full block that a member of `group` also starts with and the
        prefix cache does not hold: computing it twice in one group is work the next group gets for free."""
        block = self.prefix_cache.block_size
        first = sequence.prompt[:block]
        if len(first) < block or not any(member.prompt[:block] == first for member in group):
            return False
        return not self.prefix_cache.holds(first)

    def _iteration(self) -> None:
        self._drop_cancelled_waiting()
        self.fed = self.decoded = 0  # prompt tokens and sequences decoded this iteration (set by the steps)
        group = self.prefilling
        if group is not None and all(sequence.cancelled for sequence in group.rows):
            self.prefilling = group = None
        if group is not None and self._fuses(group):
            self._fused_step(group)
        else:
            if group is not None:
                self._prefill_alone(group)
            if self.batch.rows:
                self._decode_step()
        self.step_log.append((self.fed, self.decoded))

    def _prefill_alone(self, group: Prefill) -> None:
        """`_prefill`, failing only the group's requests where it fails (e.g. a prompt the graph rejects)."""
        try:
            self._prefill(group)
        except Exception as error:
            log.exception("prefill failed")
            self.prefilling = None
            for sequence in group.rows:
                self._finish(sequence, Event(None, "error", f"{type(error).__name__}: {error}"))

    def _fuses(self, group: Prefill) -> bool:
        """Whether this iteration computes the running rows' tokens and the group's next chunk in one call: where
        the batch takes both at once (`step_with_prefill`, the paged batch), without speculation (whose steps feed
        several tokens a row)."""
        return self.speculator is None and hasattr(self.batch, "step_with_prefill")

    def _drop_cancelled_waiting(self) -> None:
        if any(sequence.cancelled for sequence in self.waiting):
            with self.wakeup:  # reentrant: `_loop` calls this holding it
                self.waiting = deque(sequence for sequence in self.waiting if not sequence.cancelled)

    def _prefill(self, group: Prefill) -> None:
        """One chunk of the group's prompts: as many columns as the token budget leaves after the running sequences'
        decoding step; after the last chunk, their first tokens, and they join the batch."""
        # The rows of the group decode in this iteration too when this chunk is their last.
        budget = self.max_num_batched_tokens - len(self.batch) - len(group.rows)
        columns = max(1, budget // len(group.rows))
        start = group.computed
        with self.timed("prefill"):
            logits = group.run(columns)
        self.fed = group.computed - start
        self._after_chunk(group, logits)

    def _after_chunk(self, group: Prefill, logits: np.ndarray) -> None:
        """Once the group is in, it joins the batch; before, the prompts already in join where the group can hand
        them over (`take_finished`: the paged batch, whose rows are independent), so that each request's first
        token waits for its own prompt only."""
        if group.done:
            self.prefilling = None
            self._prefilled(group, logits)
        elif hasattr(group, "take_finished") and (finished := group.take_finished()) is not None:
            self._prefilled(*finished)

    def _prefilled(self, group: Prefill, logits: np.ndarray) -> None:
        """The group's prompts are in: their first tokens from `logits` (rows, vocab), and they join the batch."""
        with self.timed("sampling"):
            tokens = choose_tokens(logits, group.rows)
        self._accept(group.rows, tokens)
        if self.prefix_cache is not None:
            with self.timed("prefix_cache"):
                for row, sequence in enumerate(group.rows):
                    self.prefix_cache.store(sequence.prompt, partial(group.row_cache, row))
        keep = [i for i, sequence in enumerate(group.rows) if not (sequence.finished or sequence.cancelled)]
        with self.timed("join"):
            self.batch.join(group, keep)

    def _running_rows(self) -> list[Sequence]:
        """The batch's rows once the cancelled ones have left."""
        rows = self.batch.rows
        with self.timed("leave"):
            self.batch.keep([i for i, sequence in enumerate(rows) if not sequence.cancelled])
        return self.batch.rows

    def _decode_step(self) -> None:
        rows = self._running_rows()
        if not rows:
            return
        if self.speculator is not None and self._speculative_step(rows):
            return
        tokens, masks = self._step_inputs(rows)
        with self.timed("decode"):
            logits = self.batch.step(tokens)
        self._decoded(rows, logits, masks)

    def _fused_step(self, group: Prefill) -> None:
        """One call for the running rows' next tokens and the group's next chunk (as vLLM's and OpenVINO GenAI's
        steps mix them): the budget less a token per running row goes to the chunk (all of it while none runs), and
        the group's rows decode from the next iteration. Where the call fails, the two run apart, so that a bad
        prompt fails only its requests."""
        rows = self._running_rows()
        tokens, masks = self._step_inputs(rows)
        start = group.computed
        try:
            with self.timed("decode" if rows else "prefill"):
                logits, prompt_logits = self.batch.step_with_prefill(
                    tokens, group, self.max_num_batched_tokens - len(rows)
                )
        except Exception:
            log.exception("a decoding step with a prompt chunk failed; running the two apart")
            if masks is not None:
                masks.result()
            self._prefill_alone(group)
            if self.batch.rows:
                self._decode_step()
            return
        self.fed = group.computed - start
        if rows:
            self._decoded(rows, logits, masks)
        self._after_chunk(group, prompt_logits)

    def _step_inputs(self, rows: list[Sequence]) -> tuple[np.ndarray, Any]:
        """Each row's last token, and its grammar's mask for the next one being computed (None without grammars)."""
        tokens = np.array([sequence.generated[-1] for sequence in rows], dtype=np.int64)
        # The grammars' masks for this step's tokens are computed beside the step (llguidance and ONNX Runtime both
        # release the GIL), off the critical path as vLLM computes them.
        matchers = [sequence.sampler.matcher for sequence in rows if sequence.sampler.matcher is not None]
        return tokens, (self.mask_worker.submit(fill_masks, matchers) if matchers else None)

    def _decoded(self, rows: list[Sequence], logits: np.ndarray, masks: Any) -> None:
        """A decoding step's logits (rows, vocab): each row's token chosen and accepted, the finished rows gone."""
        self.decoded = len(rows)
        if masks is not None:
            with self.timed("grammar"):
                masks.result()
        self.steps += 1
        with self.timed("sampling"):
            tokens = choose_tokens(logits, rows)
        self._accept(rows, tokens)
        self._leave(rows)

    def _leave(self, rows: list[Sequence]) -> None:
        """Drop the finished rows from the batch, their tokens stored in the prefix cache first."""
        if self.prefix_cache is not None:
            with self.timed("prefix_cache"):
                for row, sequence in enumerate(rows):
                    if sequence.finished:  # its tokens but the last, which was never fed
                        fed = sequence.prompt + sequence.generated[:-1]
                        self.prefix_cache.store(fed, partial(self.batch.row_cache, row))
        with self.timed("leave"):
            self.batch.keep([i for i, sequence in enumerate(rows) if not sequence.finished])

    def _speculative_step(self, rows: list[Sequence]) -> bool:
        """A decoding step that verifies each row's proposed tokens (`Speculator`); False, having done nothing, where
        this step should be a plain one. Each row's tokens are accepted in order, as if decoded one per step."""
        proposed = self.speculator.proposals(rows, self.model.context_length)
        if proposed is None:
            return False
        with self.timed("decode"):
            chosen = self.speculator.step(self.batch, rows, proposed)
        self.steps += 1
        self.decoded = len(rows) + sum(len(tokens) for tokens in proposed)  # each row's last token and proposals
        for depth in range(max(len(choices) for choices in chosen)):
            at_depth = [(row, choices[depth]) for row, choices in enumerate(chosen) if len(choices) > depth]
            at_depth = [(rows[row], choice) for row, choice in at_depth if not rows[row].finished]
            self._accept([sequence for sequence, _ in at_depth], [choice for _, choice in at_depth])
        self._leave(rows)
        return True

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - start
        if part == "decode":  # a decoding step ran over the batch's rows
            for listener in self.step_listeners:
                listener(len(self.batch))

    def _accept(self, sequences: list[Sequence], choices: list[TokenChoice]) -> None:
        for sequence, choice in zip(sequences, choices):
            if choice.error is not None:  # this sequence alone fails; the others keep their tokens
                self._finish(sequence, Event(None, "error", f"choosing sequence {sequence.id}'s token: {choice.error}"))
                continue
            token = choice.token
            sequence.generated.append(token)
            params = sequence.params
            reason = None
            if token in params.ends:
                reason = "stop"
            elif sequence.sampler.matcher is not None and sequence.sampler.matcher.finished:
                reason = "stop"  # the grammar is complete: nothing may follow
            elif len(sequence.generated) >= params.max_tokens or sequence.position + 1 >= self.model.context_length:
                reason = "length"
            if reason is None:
                sequence.emit(Event(token, logprobs=choice.logprobs))
            else:
                self._finish(sequence, Event(token, reason, logprobs=choice.logprobs))

    def _finish(self, sequence: Sequence, event: Event) -> None:
        """Send `sequence`'s final event, unless it already had one (`cancel` and the scheduler thread may race)."""
        with self.finishing:
            if sequence.finished:
                return
            sequence.finished = True
        sequence.emit(event)

    def _fail_all(self, message: str, waiting: bool = False) -> None:
        """End the running and prefilling sequences with an error event; with `waiting`, the waiting ones too."""
        prefilling = self.prefilling
        failed = list(self.batch.rows) + (prefilling.rows if prefilling else [])
        self.prefilling = None
        if waiting:
            with self.wakeup:
                failed += self.waiting
                self.waiting = deque()
        for sequence in failed:
            self._finish(sequence, Event(None, "error", message))
        self.batch.keep([])  # last: after a dying thread's failure the batch may be broken, the owners are told


def choose_tokens(logits: np.ndarray, sequences: list[Sequence]) -> list[TokenChoice]:
    """The next token of each row of `logits` (batch, vocab), chosen by its sequence's sampler; a row that fails gets
    its error instead (see `sampling.choose_tokens`)."""
    return choose_row_tokens(logits, [sequence.sampler for sequence in sequences])
