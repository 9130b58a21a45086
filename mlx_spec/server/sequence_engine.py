"""One request at a time behind the batch engine's interface, for the server's one worker.

The worker (worker.py) drives an engine: `insert` a row, `step` until it ends,
`cancel` it. The batch engine (mlx_spec.batch) decodes every row at once; this
one decodes them one after another, in arrival order, through
`stream_generate` (the single-sequence loop, loop.py): what the batch engine
cannot take runs here (a target or draft of a recurrent family the batch has not been
tested on, a family whose code cannot share a batch, or quantized KV caches: `--kv-bits`),
with or without `--no-batching`. Each
request's policy starts from what the ones before it measured of the machine
(`MachineRecord`), as a batch row alone does. `room` is 1 while
nothing runs, so the worker hands it the next row only then, and takes that
row's prompt cache from the store only then (after the row before it stored
its own).

Each `step` is one token (a `RowOutput` of one). A row's prompt cache holds,
once it ends or is cancelled, exactly its prompt and the tokens handed out
(the generator is closed then). A request the API refuses (`ValueError`) or a
generation that fails ends its own row only: `RowFailed`.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional

import mlx.core as mx

from ..batch.rows import RowOutput, RowRequest
from ..batch.engine import is_draft_model
from ..cache import make_cache
from ..generate import stream_generate
from ..policy import MachineRecord

logger = logging.getLogger("mlx_spec.server")


class RowFailed(Exception):
    """One row could not go on: the worker answers it with `status` and `message`."""

    def __init__(self, uid: int, status: int, message: str):
        super().__init__(message)
        self.uid, self.status, self.message = uid, status, message


@dataclass
class _Waiting:
    uid: int
    request: RowRequest
    cache: Optional[list]
    cached: int


@dataclass
class _Running:
    uid: int
    request: RowRequest
    cache: Optional[list]
    stream: object
    handed: int = 0
    stats: object = None


class SequenceEngine:
    """`options`: the server's SpeculationOptions; `calibration`: the machine's, read once."""

    def __init__(self, target_model, tokenizer, draft_model=None, options=None,
                 calibration=None):
        self.target_model, self.tokenizer, self.draft_model = target_model, tokenizer, draft_model
        self.options, self.calibration = options, calibration
        # What each request's policy measured of the machine, handed to the next one's (as
        # the batch engine's single-row policy does: AdaptivePolicy.next_request)
        self.machine = MachineRecord()
        self.waiting: Deque[_Waiting] = deque()
        self.current: Optional[_Running] = None
        self._uids = itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.current)

    @property
    def room(self) -> int:
        """How many more rows it takes now: one when nothing runs or waits."""
        return 0 if self.busy else 1

    def new_cache(self) -> list:
        """A prompt cache for these models (the target's, then a draft model's)."""
        cache = make_cache(self.target_model)
        if is_draft_model(self.draft_model):
            cache += make_cache(self.draft_model)
        return cache

    def insert(self, request: RowRequest, cache: Optional[list] = None, cached: int = 0) -> int:
        uid = next(self._uids)
        self.waiting.append(_Waiting(uid, request, cache, cached))
        return uid

    def cancel(self, uid: int) -> Optional[RowOutput]:
        """End a row now: its cache (with keep_cache) then holds its prompt and what was handed."""
        for row in list(self.waiting):
            if row.uid == uid:
                self.waiting.remove(row)
                return RowOutput(uid, [], "cancelled", 0, 0, "target")
        row = self.current
        if row is None or row.uid != uid:
            return None
        self._end()
        return RowOutput(uid, [], "cancelled", 0, 0, "target",
                         cache=row.cache if row.request.keep_cache else None, stats=row.stats)

    def step(self) -> List[RowOutput]:
        """The running row's next token (starting the next waiting row if none runs)."""
        if self.current is None:
            if not self.waiting:
                return []
            self.current = self._start(self.waiting.popleft())
        row = self.current
        try:
            response = next(row.stream)
        except ValueError as exc:  # an argument the API refused: before or after tokens
            self._end()
            raise RowFailed(row.uid, 500 if row.handed else 400, str(exc)) from None
        except Exception:  # never let one request end the others; the log has the why
            logger.exception("generation failed")
            self._end()
            raise RowFailed(row.uid, 500, "Generation failed on the server; its log has the "
                                          "details.") from None
        row.handed += 1
        row.stats = response.stats
        finish = response.finish_reason
        if finish is not None:
            self._end()
        logprobs = response.logprobs[None] if row.request.logprobs else None
        return [RowOutput(row.uid, [response.token], finish, int(response.from_draft),
                          int(response.from_draft), response.source, logprobs,
                          cache=row.cache if finish is not None and row.request.keep_cache
                          else None, stats=row.stats)]

    def _start(self, row: _Waiting) -> _Running:
        r, o = row.request, self.options
        s = r.sampling
        cache = row.cache if row.cache is not None else (
            self.new_cache() if r.keep_cache else None)
        processors = list(r.logits_processors or ())
        if processors and row.cached:  # they see the prompt a reused cache holds, too
            before = mx.array(r.prompt[:row.cached], mx.uint32)
            processors = [_after(before, p) for p in processors]
        stream = stream_generate(
            self.target_model, self.tokenizer, r.prompt[row.cached:],
            draft_model=self.draft_model, max_tokens=r.max_tokens, prompt_cache=cache,
            # Closed when the row ends, so the cache need only be right then: no per-token
            # upkeep (a draft pass per plain-decoded token), no round-end token held back.
            prompt_cache_live=False,
            **({"sampler": s.sampler} if s.sampler is not None else dict(
                temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)), seed=r.seed,
            logits_processors=processors or None, num_draft_tokens=r.num_draft_tokens,
            prompt_lookup=r.prompt_lookup, suffix=r.suffix,
            adaptive=o.adaptive, max_draft_tokens=o.max_draft_tokens, auto_off=o.auto_off,
            draft_confidence=o.draft_confidence,
            prompt_lookup_max_ngram=r.prompt_lookup_max_ngram,
            calibration=self.calibration, mtp_weights=o.mtp_weights, tree=o.tree,
            machine=self.machine, kv_bits=o.kv_bits, kv_group_size=o.kv_group_size,
            quantized_kv_start=o.quantized_kv_start, prefill_step_size=o.prefill_step_size)
        return _Running(row.uid, r, cache, stream)

    def _end(self) -> None:
        """Close the running row's generator: a reused cache now holds its prompt and output."""
        row, self.current = self.current, None
        row.stream.close()


def _after(before: mx.array, processor):
    """`processor` handed `before` in front of the tokens it is called with."""
    return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(mx.uint32)]),
                                            logits)
