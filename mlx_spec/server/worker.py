"""The one generation thread: jobs in a FIFO queue, tokens streamed back, cancel between tokens.

MLX generation is not thread-safe (docs/python-api.md, "Thread safety"), so every
generation runs on this one thread, one job at a time, in arrival order.
The HTTP side `submit`s a `Job` and reads the events the job's sink is given:
`TextDelta`s, then one `Finished` or `Failed`. Admission: at most
`max_concurrency` jobs are queued or running; `submit` raises `Busy` beyond
that, at once (the server answers 429). A slot is free again as soon as its
job ends.

`worker.cancel(job)` (the client left) frees a queued job's slot at once; a
running job sees it between tokens: the worker closes the generator, which leaves a reused prompt cache holding exactly the prompt and
the tokens handed out, so the cache goes back to the store, and frees the
slot. A cancelled job still queued is skipped. A stop string is handled the same way: the text
before it is sent, then the generator is closed.

A job with suffix drafting on drafts from the index of its partition
(suffix_scope.py), which its prompt and output then join.

The thread calls `mx.clear_streams()` before it ends (docs/python-api.md, "Thread safety").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Sequence

import mlx.core as mx

from ..cache import make_cache
from ..defaults import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_NGRAM
from ..dflash import is_dflash_model
from ..eagle3 import is_eagle3_head
from ..generate import stream_generate
from ..stats import GenerationStats
from .cache_store import PromptCacheStore
from .requests import GenerationRequest
from .stop_strings import StopMatcher
from .suffix_scope import SuffixScopes

DEFAULT_MAX_CONCURRENCY = 16
CANCELLED = "The request was cancelled: the client left or the server is shutting down."
logger = logging.getLogger("mlx_spec.server")


@dataclass(frozen=True)
class TextDelta:
    text: str
    # Per token whose text this delta releases, with logprobs asked for:
    # (token text, its log-probability, ((alternative text, log-probability), ...)).
    logprobs: tuple = ()


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in a stored prompt cache (not prefilled)
    completion_tokens: int
    stats: Optional[GenerationStats]


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


class Busy(Exception):
    """No slot free (status 429), or the server is closing (503): the request is not admitted."""

    def __init__(self, message: str, status: int = 429):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SpeculationOptions:
    """The server-wide speculation settings (the `serve` flags); a request can pin k and lookup."""

    adaptive: Optional[bool] = None
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    auto_off: bool = True
    draft_confidence: float = 0.0
    prompt_lookup_max_ngram: int = DEFAULT_MAX_NGRAM
    calibration: Optional[str] = "auto"  # "auto": this machine's `mlx-spec tune` file, if any
    mtp_weights: Optional[str] = None  # with draft_model="mtp": where the MTP head's weights are
    tree: Optional[tuple] = None  # token trees: (depth, width), False (chains), None (policy's)


class Job:
    """One admitted request: its prompt ids, token budget, an event sink, a cancel flag and its
    suffix partition (`SuffixScopes.partition`: a digest of its API key, never the key)."""

    def __init__(self, request: GenerationRequest, prompt_ids: List[int], max_tokens: int,
                 sink: Callable[[object], None], partition: Optional[str] = None):
        self.request, self.prompt_ids, self.max_tokens = request, list(prompt_ids), max_tokens
        self.partition = partition
        self._sink = sink
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event) -> None:
        try:
            self._sink(event)
        except RuntimeError:  # the HTTP side's event loop has closed: nobody is listening
            self.cancel()


class GenerationWorker:
    """Owns the models, the prompt cache store and the suffix indexes (by default in-memory,
    one per API key); runs the jobs on one thread. `draft_model` is a draft model (of the
    target's tokenizer, or of another when `mlx_spec.load` kept the draft's), a DFlash drafter,
    an EAGLE-3 head, "mtp" (the target's own MTP head, weights from `options.mtp_weights`) or
    None."""

    def __init__(self, target_model, tokenizer, draft_model=None,
                 options: SpeculationOptions = SpeculationOptions(),
                 store: Optional[PromptCacheStore] = None,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 suffix: Optional[SuffixScopes] = None):
        if options.mtp_weights is not None and not is_mtp(draft_model):
            raise ValueError('mtp_weights is only used with draft_model="mtp"; pass both, or '
                             'neither.')
        self.target_model, self.tokenizer, self.draft_model = target_model, tokenizer, draft_model
        self.options, self.store, self.max_concurrency = options, store, max_concurrency
        self.suffix = suffix if suffix is not None else SuffixScopes()
        self.calibration = _resolve_calibration(options.calibration, target_model)
        self._pending: Deque[Optional[Job]] = collections.deque()  # None: the thread's end
        self._admitted: set = set()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closing = False
        self.running: Optional[Job] = None
        self._thread = threading.Thread(target=self._loop, name="mlx-spec-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise Busy when max_concurrency jobs are already queued or running."""
        with self._lock:
            if self._closing:
                raise Busy("The server is shutting down.", 503)
            if len(self._admitted) >= self.max_concurrency:
                raise Busy(f"The server is busy: {len(self._admitted)} requests are queued or "
                           f"running (--max-concurrency {self.max_concurrency}); retry shortly.")
            self._admitted.add(job)
            self._pending.append(job)
            self._ready.notify()

    @property
    def admitted(self) -> int:
        return len(self._admitted)

    def close(self, timeout: Optional[float] = None) -> None:
        """Cancel every admitted job, let the thread finish and clear its streams."""
        with self._lock:
            self._closing = True
            jobs = list(self._admitted)
        for job in jobs:
            self.cancel(job)
        if self._thread.is_alive():
            with self._lock:
                self._pending.append(None)
                self._ready.notify()
            self._thread.join(timeout)

    def cancel(self, job: Job) -> None:
        """Stop `job`: a queued one leaves the queue and frees its slot now (nothing of it is
        kept), a running one stops before its next token."""
        with self._lock:
            job.cancel()
            queued = job is not self.running and job in self._admitted
            if job is not self.running:
                self._admitted.discard(job)
            if queued:
                with contextlib.suppress(ValueError):
                    self._pending.remove(job)
        if queued:
            job.emit(Failed(503, CANCELLED))

    @property
    def queued(self) -> int:
        return len(self._pending)

    def _next(self) -> Optional[Job]:
        with self._ready:
            while not self._pending:
                self._ready.wait()
            job = self._pending.popleft()
            self.running = job
            return job

    def _loop(self) -> None:
        try:
            while (job := self._next()) is not None:
                try:
                    last = self._generate(job)
                except Exception:  # never let one request end the thread; the log has the why
                    logger.exception("generation failed")
                    last = Failed(500, "Generation failed on the server; its log has the details.")
                with self._lock:  # the slot is free before the client hears the end
                    self.running = None
                    self._admitted.discard(job)
                job.emit(last)
        finally:
            mx.clear_streams()

    def _generate(self, job: Job):
        """Stream the job's text; return its last event (Finished or Failed) for the loop to send."""
        cache, cached = self._cache_for(job.prompt_ids)
        stops = StopMatcher(job.request.stop)
        handed: List[int] = []  # every token the generator gave, the EOS included
        response, finish = None, None
        top = job.request.logprobs
        pending: list = []  # logprob entries of tokens whose text is not sent yet
        stream = stream_generate(
            self.target_model, self.tokenizer, job.prompt_ids[cached:], draft_model=self.draft_model,
            max_tokens=job.max_tokens, prompt_cache=cache,
            # Closed below whatever happens, so the cache need only be right then: no per-token
            # upkeep (a draft pass per plain-decoded token), no round-end token held back.
            prompt_cache_live=False, **self._arguments(job, cached))
        try:
            for response in stream:
                handed.append(response.token)
                if job.cancelled:
                    break
                if top is not None and response.finish_reason != "stop":  # (the EOS: no text)
                    pending.append(self._logprob_entry(response.token, response.logprobs, top))
                text, stopped = stops.feed(response.text)
                if text:
                    job.emit(TextDelta(text, tuple(pending)))
                    pending = []
                if stopped:
                    finish = "stop"
                    break
                finish = response.finish_reason
        except ValueError as exc:  # an argument the API refused before generating
            return Failed(500 if handed else 400, str(exc))
        finally:
            stream.close()  # a reused cache now holds the prompt and `handed`
        if self.store is not None:
            self.store.put(job.prompt_ids + handed, cache)
        if finish is None:
            return Failed(503, CANCELLED)
        rest = stops.flush()
        if rest:
            job.emit(TextDelta(rest, tuple(pending)))
        eos = response.finish_reason == "stop"  # the last response carries the EOS token
        return Finished(finish, len(job.prompt_ids), cached, len(handed) - int(eos), response.stats)

    def _logprob_entry(self, token: int, logprobs: mx.array, top: int) -> tuple:
        """(token text, log-probability, top alternatives): the target's own distribution at
        that position (`logprobs` (V,), after any logits processors), the one the token was
        drawn under."""
        chosen = logprobs[token]
        if not top:
            return self.tokenizer.decode([token]), chosen.item(), ()
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        order = mx.argsort(-logprobs[ids])
        ids, values = ids[order], logprobs[ids][order]
        mx.eval(chosen, ids, values)  # one sync for the three
        alternatives = tuple((self.tokenizer.decode([i]), v)
                             for i, v in zip(ids.tolist(), values.tolist()))
        return self.tokenizer.decode([token]), chosen.item(), alternatives

    def _cache_for(self, prompt_ids: List[int]):
        """(a cache to generate with, how many prompt tokens it already holds)."""
        if self.store is None:
            return None, 0
        cache, cached = self.store.take(prompt_ids)
        if cache is None:
            cache = make_cache(self.target_model)
            if self.draft_model is not None and not (is_dflash_model(self.draft_model)
                                                     or is_eagle3_head(self.draft_model)
                                                     or is_mtp(self.draft_model)):
                cache += make_cache(self.draft_model)  # a head or block drafter: none here
        return cache, cached

    def _arguments(self, job: Job, cached: int = 0) -> dict:
        """stream_generate's keywords for `job`, whose first `cached` prompt tokens a stored
        cache holds (they are not passed, but the penalties still see them)."""
        o, s = self.options, job.request.settings
        return dict(temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
                    logits_processors=_processors(s, job.prompt_ids[:cached]),
                    num_draft_tokens=s.num_draft_tokens, prompt_lookup=s.prompt_lookup,
                    suffix=self.suffix.index_for(job.partition) if s.suffix else None,
                    adaptive=o.adaptive, max_draft_tokens=o.max_draft_tokens, auto_off=o.auto_off,
                    draft_confidence=o.draft_confidence,
                    prompt_lookup_max_ngram=o.prompt_lookup_max_ngram,
                    calibration=self.calibration, mtp_weights=o.mtp_weights, tree=o.tree)


def is_mtp(draft_model) -> bool:
    """Whether `draft_model` names the target's own MTP head."""
    return isinstance(draft_model, str) and draft_model == "mtp"


def _processors(settings, earlier: Sequence[int] = ()) -> Optional[list]:
    """mlx-lm's logits processors for a request's logit_bias and penalties (None: none asked).

    The penalties look at the whole conversation as the model sees it, prompt and generated
    so far, whatever a stored cache holds: each processor is handed `earlier` (the prompt
    tokens a reused cache holds, which the generation call is not given) in front of the
    tokens it is called with, so a cache hit answers as a miss does, and as the batched
    worker, whose rows hold the whole prompt."""
    if not (settings.logit_bias or settings.presence_penalty or settings.frequency_penalty
            or settings.repetition_penalty is not None):
        return None
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(logit_bias=dict(settings.logit_bias) or None,
                                        repetition_penalty=settings.repetition_penalty,
                                        presence_penalty=settings.presence_penalty or None,
                                        frequency_penalty=settings.frequency_penalty or None)
    if not earlier:
        return processors
    before = mx.array(list(earlier), mx.uint32)
    return [_after(before, processor) for processor in processors]


def _after(before: mx.array, processor):
    """`processor` handed `before` in front of the tokens it is called with."""
    return lambda tokens, logits: processor(mx.concatenate([before, tokens.astype(mx.uint32)]),
                                            logits)


def _resolve_calibration(calibration, target_model):
    """Read this machine's calibration once, not at every request."""
    if calibration != "auto":
        return calibration
    from ..calibration import load_calibration

    try:
        return load_calibration(target_model)
    except ValueError as exc:  # a corrupt file must not stop the server
        warnings.warn(f"{exc} Serving without it.", stacklevel=2)
        return None
