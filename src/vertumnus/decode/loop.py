"""The one thread that steps a ``DecodeEngine`` (``engine.py``): ``DecodeLoop``, and
what crosses into it and out of it. A request hands it a ``NewSequence`` and a
``Deliver``; each token comes back through that as a ``StepOutput``, or a
``DecodeFailure`` ends the sequence. A ``NewSequence`` of ``copies`` > 1 is one
prefill, one pulled prompt KV, forked here: every copy joins as a sequence of its
own (its own seq id, cache and generator: copy i decodes with
``params.for_copy(i)``), all from the one ``PromptKV``, released once all have
joined; each copy's tokens come through the same ``Deliver``, told apart by their
``seq_id``, and each copy can be cancelled alone. Not here: the step itself
(``engine.py``), HTTP (``server.py``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
from torch import Tensor

from vertumnus.decode.engine import DecodeEngine, StepOutput
from vertumnus.decode.prompt_kv import PromptKV
from vertumnus.engine.dsv4.state import DsV4State
from vertumnus.protocol.sampling_params import SamplingParams

log = structlog.get_logger("vertumnus.decode")


@dataclass(frozen=True)
class NewSequence:
    """What a request hands the decode thread: ``DecodeEngine.add``'s arguments, once
    for every one of its ``copies`` (``n``, or ``best_of``, sequences from one prompt).
    ``prompt_ids``: the whole prompt (its last id is ``last_token``), which
    ``repetition_penalty`` counts as seen; ``logprobs``: the top alternatives each
    token reports (None: its own log-probability alone)."""

    prompt_kv: PromptKV | Sequence[tuple[Tensor, Tensor]] | DsV4State  # (V4: its state)
    last_token: int
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # called once the prompt's KV is in every copy's cache (or refused): its memory is free
    release: Callable[[], None] | None = None
    prompt_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    copies: int = 1


@dataclass(frozen=True)
class DecodeFailure:
    """The sequence could not join or its step failed; it is out of the batch."""

    seq_id: int
    message: str


# Called on the decode thread with each token (or the failure) and the time it was
# chosen (``time.perf_counter``); it must not block (``loop.call_soon_threadsafe``).
Deliver = Callable[[StepOutput | DecodeFailure, float], None]


@dataclass
class _Inbox:
    adds: list[tuple[list[int], NewSequence, Deliver]] = field(default_factory=list)
    cancels: set[int] = field(default_factory=set)


class DecodeLoop:
    """The one thread that steps a ``DecodeEngine`` while sequences are active.

    ``submit`` and ``cancel`` may be called from any thread: they queue the change,
    which the decode thread applies between steps (cancellations first, then joins).
    Every sequence gets each of its tokens through its ``Deliver``, then nothing more
    after the one with a ``finish_reason`` or a ``DecodeFailure``; a cancelled one
    gets nothing more. ``close`` fails what is left and joins the thread."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._stopping = False
        self._ids = itertools.count()
        self._deliver: dict[int, Deliver] = {}  # the decode thread's own
        self._thread = threading.Thread(target=self._run, name="vertumnus-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def num_active(self) -> int:
        """Sequences decoding (approximate from another thread)."""
        return len(self.engine)

    def submit(self, seq: NewSequence, deliver: Deliver) -> list[int]:
        """Queue a sequence's copies to join at the next step; returns their ids, copy
        i's at index i."""
        if seq.copies < 1:
            raise ValueError(f"copies must be >= 1, got {seq.copies}")
        with self._cond:
            if self._stopping:
                raise RuntimeError("the decode loop is closed")
            seq_ids = [next(self._ids) for _ in range(seq.copies)]
            self._inbox.adds.append((seq_ids, seq, deliver))
            self._cond.notify()
        return seq_ids

    def cancel(self, seq_id: int) -> None:
        """Take the sequence out of the batch before the next step (no-op if done)."""
        with self._cond:
            self._inbox.cancels.add(seq_id)
            self._cond.notify()

    def close(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _take(self) -> _Inbox | None:
        """The queued changes, waiting while there is nothing to do; None: stop."""
        with self._cond:
            while not (
                self._stopping or self._inbox.adds or self._inbox.cancels or len(self.engine)
            ):
                self._cond.wait()
            inbox, self._inbox = self._inbox, _Inbox()
            if self._stopping:  # what was queued fails with the rest
                for seq_ids, seq, deliver in inbox.adds:
                    self._deliver.update(dict.fromkeys(seq_ids, deliver))
                    if seq.release is not None:
                        seq.release()
                return None
            return inbox

    def _run(self) -> None:
        while True:
            inbox = self._take()
            if inbox is None:
                break
            self._apply(inbox)
            del inbox  # the prompts' pulled KV: in the caches now, not kept twice
            if len(self.engine):
                self._step()
        self._fail_all("the decode server is shutting down")

    def _apply(self, inbox: _Inbox) -> None:
        for seq_id in inbox.cancels:
            self.engine.remove(seq_id)
            self._deliver.pop(seq_id, None)
        for seq_ids, seq, deliver in inbox.adds:
            try:
                for copy, seq_id in enumerate(seq_ids):
                    if seq_id not in inbox.cancels:
                        self._add(seq_id, copy, seq, deliver)
            finally:
                if seq.release is not None:
                    seq.release()

    def _add(self, seq_id: int, copy: int, seq: NewSequence, deliver: Deliver) -> None:
        try:
            self.engine.add(
                seq_id,
                seq.prompt_kv,
                seq.last_token,
                seq.params.for_copy(copy),
                seq.max_tokens,
                seq.eos_token_ids,
                seq.ignore_eos,
                stop_token_ids=seq.stop_token_ids,
                min_tokens=seq.min_tokens,
                prompt_ids=seq.prompt_ids,
                logprobs=seq.logprobs,
            )
        except (ValueError, RuntimeError) as exc:  # bad KV, or out of memory
            self._send(deliver, DecodeFailure(seq_id, f"cannot decode: {exc}"))
            return
        self._deliver[seq_id] = deliver

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug or out of memory: the batch fails, the loop goes on
            log.exception("decode_step_failed", sequences=len(self.engine), error=repr(exc))
            self._fail_all(f"decode step failed: {type(exc).__name__}: {exc}")
            return
        now = time.perf_counter()
        for out in outputs:
            deliver = self._deliver.get(out.seq_id)
            if out.finish_reason is not None:
                self._deliver.pop(out.seq_id, None)
            if deliver is not None and not self._send(deliver, out, now):
                self.engine.remove(out.seq_id)  # nobody listens any more
                self._deliver.pop(out.seq_id, None)

    def _fail_all(self, message: str) -> None:
        for seq_id in self.engine.seq_ids:
            self.engine.remove(seq_id)
        for seq_id, deliver in list(self._deliver.items()):
            self._send(deliver, DecodeFailure(seq_id, message))
        self._deliver.clear()

    @staticmethod
    def _send(
        deliver: Deliver, event: StepOutput | DecodeFailure, now: float | None = None
    ) -> bool:
        try:
            deliver(event, time.perf_counter() if now is None else now)
        except RuntimeError:  # its event loop is closed
            return False
        return True
