"""The one generation thread: jobs admitted, decoded by an engine, their text streamed back.

MLX generation is not thread-safe (docs/python-api.md, "Thread safety"), so every
generation runs on this one thread. The HTTP side `submit`s a `Job` and reads
the events the job's sink is given: `TextDelta`s, then one `Finished` or
`Failed`. Admission: at most `max_concurrency` jobs are queued or running;
`submit` raises `Busy` beyond that, at once (the server answers 429). A slot
is free again as soon as its job ends.

The thread drives the batch engine: between two steps it hands the engine
every queued job it has room for (with the prompt cache the store holds for
it), drops the jobs whose client left, runs one step (a round) and streams each
job its tokens (detokenized here, cut at a stop string). The engine takes every
admitted job at once and decodes them together (`batching=True`, when both
models batch: `can_batch`), or one job at a time, in arrival order
(`batching=False`: a batch of one); one at a time it also takes what a batch
cannot hold, each row on its models' own cache kinds (batch/solo.py: quantized
KV caches, the families in batch/kv.py's UNBATCHABLE, recurrent families the
batch has not been tested on).
Either way a job's prompt cache goes back to the store holding its prompt and
every token generated, and the penalties see the whole conversation, whatever
the cache held (test_server_penalties.py).

`worker.cancel(job)` (the client left) frees a queued job's slot at once; a
running one ends before the next step. A stop string ends the job the same
way, after the text before it is sent. A job with suffix drafting on drafts
from the index of its partition (suffix_scope.py), which its prompt and output
then join. The thread calls `mx.clear_streams()` before it ends.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

import mlx.core as mx

from ..acceptance import rule_name
from ..assemble import resolve_calibration
from ..batch import BatchEngine, RowRequest
from ..batch.engine import check_batchable
from ..defaults import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_NGRAM,
                        DEFAULT_NUM_DRAFT_TOKENS, DEFAULT_QUANTIZED_KV_START)
from ..sampling import SamplingConfig
from ..stats import GenerationStats, StatsRecorder
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
    # mlx-lm's KV cache quantization (None: none): requests one at a time, on their own caches
    kv_bits: Optional[int] = None
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    # prompt tokens a prefill chunk feeds (None: 512; with kv_bits, mlx-lm's 2048)
    prefill_step_size: Optional[int] = None


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


@dataclass
class Running:
    """A job in the engine: its detokenizer, stop strings and tokens so far."""

    job: Job
    uid: int
    cached: int
    detokenizer: object
    stops: StopMatcher
    tokens: List[int]  # handed to the client (up to a stop string)
    generated: List[int]  # everything the row generated (what its cache holds)
    recorder: StatsRecorder
    stats: Optional[GenerationStats] = None  # the engine's own, where it keeps them


class GenerationWorker:
    """Owns the models, the engine, the prompt cache store and the suffix indexes (by default
    in-memory, one per API key); runs the jobs on one thread. `draft_model` is a draft model
    (of the target's tokenizer, or of another when `mlx_spec.load` kept the draft's), a DFlash
    drafter, an EAGLE-3 head, "mtp" (the target's own MTP head, weights from
    `options.mtp_weights`) or None. `batching`: decode the jobs together in the batch engine
    (ValueError, in one sentence, when these models cannot be: see `can_batch`); otherwise
    one at a time (the batch engine holding one row, on the models' own cache kinds where a
    batch cannot hold them: batch/solo.py). `max_rows`: batched, the most requests decoding
    together (mlx-lm's --decode-concurrency; the others wait their turn, admitted), None:
    all admitted."""

    def __init__(self, target_model, tokenizer, draft_model=None,
                 options: SpeculationOptions = SpeculationOptions(),
                 store: Optional[PromptCacheStore] = None,
                 max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                 suffix: Optional[SuffixScopes] = None, batching: bool = False,
                 max_rows: Optional[int] = None):
        if options.mtp_weights is not None and not is_mtp(draft_model):
            raise ValueError('mtp_weights is only used with draft_model="mtp"; pass both, or '
                             'neither.')
        if options.kv_bits is not None and batching:
            raise ValueError("Quantized KV caches (kv_bits) are decoded one request at a time: "
                             "mlx-lm has no batched quantized cache; serve without batching.")
        if batching:
            check_batchable(target_model, draft_model, tokenizer)
        self.target_model, self.tokenizer, self.draft_model = target_model, tokenizer, draft_model
        self.options, self.store, self.max_concurrency = options, store, max_concurrency
        self.batching = batching
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (or None: every admitted request), got "
                             f"{max_rows}.")
        self.max_rows = max_rows
        self.suffix = suffix if suffix is not None else SuffixScopes()
        self.calibration = resolve_calibration(options.calibration, target_model)  # read once
        self.engine = self._new_engine()
        self._running: Dict[int, Running] = {}  # uid -> job state
        self._pending: Deque[Optional[Job]] = collections.deque()  # None: the thread's end
        self._admitted: set = set()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._closing = False
        self.running: Optional[bool] = None  # True while the engine holds a job (/health)
        self._thread = threading.Thread(target=self._loop, name="mlx-spec-generation", daemon=True)

    def _new_engine(self) -> BatchEngine:
        """The batch engine, taking every admitted job at once (`batching`) or one at a time
        (on the models' own cache kinds where a batch cannot hold them: batch/solo.py)."""
        o = self.options
        return BatchEngine(self.target_model, self.draft_model,
                           max_rows=self.max_rows if self.batching else 1,
                           max_draft_tokens=o.max_draft_tokens,
                           stop_tokens=self.tokenizer.eos_token_ids,
                           mtp_weights=o.mtp_weights, tokenizer=self.tokenizer,
                           prefill_step_size=o.prefill_step_size, tree=o.tree,
                           calibration=self.calibration, auto_off=o.auto_off,
                           draft_confidence=o.draft_confidence, kv_bits=o.kv_bits,
                           kv_group_size=o.kv_group_size,
                           quantized_kv_start=o.quantized_kv_start)

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

    @property
    def queued(self) -> int:
        return len(self._pending)

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
        kept), a running one ends before the engine's next step."""
        with self._lock:
            job.cancel()
            queued = job in self._pending
            if queued:
                self._pending.remove(job)
                self._admitted.discard(job)
        if queued:
            job.emit(Failed(503, CANCELLED))

    def _take(self) -> Optional[List[Job]]:
        """The queued jobs the engine has room for (waiting for one while nothing runs); None
        once the thread should end."""
        with self._ready:
            while not self._pending and not self.engine.busy:
                self.running = None
                self._ready.wait()
            jobs = []
            while self._pending and (self._pending[0] is None or len(jobs) < self.engine.room):
                jobs.append(self._pending.popleft())
        if None in jobs:
            return None
        self.running = True if (jobs or self.engine.busy) else None
        return jobs

    def _loop(self) -> None:
        try:
            while (jobs := self._take()) is not None:
                for job in jobs:
                    self._start_job(job)
                self._drop_cancelled()
                try:
                    outputs = self.engine.step()
                except Exception:  # never let one round end the thread; the log has the why
                    logger.exception("generation failed")
                    self._fail_all(Failed(500, "Generation failed on the server; its log has "
                                               "the details."))
                    self.engine = self._new_engine()  # its rows were in the failed round
                    continue
                if not self.engine.busy and not self._pending:  # (/health: before the last
                    self.running = None  # answer is out, so no client sees it running after)
                for out in outputs:
                    self._deliver(out)
            self._fail_all(Failed(503, CANCELLED))
        finally:
            mx.clear_streams()

    def _sampling(self, s) -> SamplingConfig:
        """A request's sampling: its temperature and filters, or, with XTC at T > 0, mlx-lm's
        own sampler drawing each token (a draft kept while it equals the sampler's draw:
        acceptance.sampler_match; mlx-lm's sampler at T = 0 is the argmax, XTC off)."""
        if s.xtc_probability > 0 and s.temp > 0:  # (its temperature: the policy's calibration)
            return SamplingConfig(temp=s.temp, sampler=xtc_sampler(s, self.tokenizer))
        return SamplingConfig(temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p)

    def _start_job(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, Failed(503, CANCELLED))
            return
        s, o = job.request.settings, self.options
        k = s.num_draft_tokens
        if k is None and o.adaptive is False:  # --fixed
            k = DEFAULT_NUM_DRAFT_TOKENS
        cache, cached = self.store.take(job.prompt_ids) if self.store is not None else (None, 0)
        request = RowRequest(
            job.prompt_ids, job.max_tokens, self._sampling(s),
            seed=s.seed, prompt_lookup=s.prompt_lookup, num_draft_tokens=k,
            logits_processors=tuple(_processors(s) or ()), logprobs=job.request.logprobs is not None,
            suffix=self.suffix.index_for(job.partition) if s.suffix else None,
            keep_cache=self.store is not None, prompt_lookup_max_ngram=o.prompt_lookup_max_ngram)
        # as a call's stats say it: whether its adaptive policy starts from the calibration
        calibrated = None if k is not None or o.adaptive is False else self.calibration is not None
        try:
            uid = self.engine.insert(request, cache, cached)
        except ValueError as exc:
            self._end(job, Failed(400, str(exc)))
            return
        self._running[uid] = Running(job, uid, cached, self.tokenizer.detokenizer,
                                     StopMatcher(job.request.stop), [], [],
                                     StatsRecorder(len(job.prompt_ids), calibrated,
                                                   rule_name(request.sampling),
                                                   getattr(self.engine, "vocab_overlap", None)))

    def _drop_cancelled(self) -> None:
        for state in [s for s in self._running.values() if s.job.cancelled]:
            out = self.engine.cancel(state.uid)
            self._store(state, out.cache if out is not None else None)
            self._running.pop(state.uid)
            self._end(state.job, Failed(503, CANCELLED))

    def _deliver(self, out) -> None:
        state = self._running[out.uid]
        pending, finish = [], None
        top = state.job.request.logprobs
        state.generated += out.tokens
        state.stats = out.stats
        if out.stats is None:  # an engine that keeps none (the batch): the worker counts
            state.recorder.prompt_done()
            state.recorder.record(out)
        for i, token in enumerate(out.tokens):
            state.tokens.append(token)
            state.recorder.handed()
            last = i + 1 == len(out.tokens) and out.finish_reason is not None
            if last and out.finish_reason == "stop":  # the engine's stop: an EOS, not text
                state.detokenizer.finalize()
            else:
                state.detokenizer.add_token(token)
                if last:
                    state.detokenizer.finalize()
                if top is not None:
                    pending.append(self._logprob_entry(token, out.logprobs[i], top))
            text, stopped = state.stops.feed(state.detokenizer.last_segment)
            if text:
                state.job.emit(TextDelta(text, tuple(pending)))
                pending = []
            if stopped:
                finish = "stop"
                break
        if finish is None and out.finish_reason is None:
            return
        if finish == "stop":  # a stop string: the row ends here
            ended = self.engine.cancel(out.uid) if out.finish_reason is None else out
            cache = ended.cache if ended is not None else None
        else:
            finish, cache = out.finish_reason, out.cache
            rest = state.stops.flush()
            if rest or pending:
                state.job.emit(TextDelta(rest, tuple(pending)))
        self._running.pop(out.uid)
        eos_ended = out.finish_reason == "stop" and i + 1 == len(out.tokens)  # EOS handed
        stats = state.stats if state.stats is not None else state.recorder.snapshot()
        self._end(state.job, Finished(finish, len(state.job.prompt_ids), state.cached,
                                      len(state.tokens) - int(bool(eos_ended)), stats))
        self._store(state, cache)

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

    def _store(self, state: Running, cache) -> None:
        if self.store is not None and cache is not None:
            self.store.put(state.job.prompt_ids + state.generated, cache)

    def _end(self, job: Job, event) -> None:
        with self._lock:  # the slot is free before the client hears the end
            self._admitted.discard(job)
        job.emit(event)

    def _fail_all(self, event) -> None:
        for state in list(self._running.values()):
            self._end(state.job, event)
        self._running.clear()


def can_batch(target_model, draft_model, tokenizer=None) -> bool:
    """Whether these models can be served batched, else one request at a time (whatever the
    options: token trees batch from every drafter the batch takes)."""
    try:
        check_batchable(target_model, draft_model, tokenizer)
    except ValueError:
        return False
    return True


def is_mtp(draft_model) -> bool:
    """Whether `draft_model` names the target's own MTP head."""
    return isinstance(draft_model, str) and draft_model == "mtp"


def xtc_sampler(settings, tokenizer):
    """mlx-lm's sampler with XTC for a request's settings, as mlx-lm's server makes it (its
    special tokens: the newline and the end-of-sequence tokens)."""
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(settings.temp, settings.top_p, settings.min_p, 1, top_k=settings.top_k,
                        xtc_probability=settings.xtc_probability,
                        xtc_threshold=settings.xtc_threshold,
                        xtc_special_tokens=tokenizer.encode("\n")
                        + list(tokenizer.eos_token_ids))


def _processors(settings) -> Optional[list]:
    """mlx-lm's logits processors for a request's logit_bias and penalties (None: none asked).
    They look at the whole conversation as the model sees it: the engine hands them the
    prompt tokens a reused cache holds, too (a row holds its whole prompt)."""
    if not (settings.logit_bias or settings.presence_penalty or settings.frequency_penalty
            or settings.repetition_penalty is not None):
        return None
    from mlx_lm.sample_utils import make_logits_processors

    return make_logits_processors(logit_bias=dict(settings.logit_bias) or None,
                                  repetition_penalty=settings.repetition_penalty,
                                  repetition_context_size=settings.repetition_context_size,
                                  presence_penalty=settings.presence_penalty or None,
                                  presence_context_size=settings.presence_context_size,
                                  frequency_penalty=settings.frequency_penalty or None,
                                  frequency_context_size=settings.frequency_context_size)


