"""The generation thread, batched: every admitted request decodes in one BatchEngine.

Same contract as worker.py's `GenerationWorker` (submit, cancel, close, the
events a job's sink is given, admission up to `max_concurrency`), but jobs do
not wait for each other: between two rounds the thread takes every newly
submitted job into the engine (its prompt is prefilled in chunks interleaved
with the others' rounds), drops the ones whose client left, runs one round
for all, and streams each job its tokens. `--max-concurrency` is thus the
batch limit. A job's prompt cache comes from the store and goes back to it
holding the prompt and every token generated, as with the one-at-a-time
worker. Used when both models batch (`can_batch`: attention and sliding-window
targets and hybrids of Gated DeltaNet, short-convolution or Mamba-2 layers;
attention drafts of the target's tokenizer, the target's MTP head, an EAGLE-3
head or a DFlash or DFlash2 drafter); other targets, a draft of another
tokenizer and token trees keep the one-at-a-time worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx

from ..batch import BatchEngine, RowRequest
from ..batch.engine import check_batchable
from ..acceptance import rule_name
from ..defaults import DEFAULT_NUM_DRAFT_TOKENS
from ..sampling import SamplingConfig
from ..stats import StatsRecorder
from .stop_strings import StopMatcher
from .worker import CANCELLED, Failed, Finished, GenerationWorker, Job, TextDelta, _processors

logger = logging.getLogger("mlx_spec.server")


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


def can_batch(target_model, draft_model, tokenizer=None, tree=None) -> bool:
    """Whether these models (and options) are served batched, else one request at a time:
    a draft of another tokenizer than `tokenizer`, or token trees (`tree`), run one at a time."""
    try:
        check_batched(target_model, draft_model, tokenizer, tree)
    except ValueError:
        return False
    return True


def check_batched(target_model, draft_model, tokenizer=None, tree=None) -> None:
    """ValueError, in one sentence, unless the batched worker serves these."""
    if tree:
        raise ValueError("Batched serving drafts chains only; serve token trees one request "
                         "at a time (mlx-spec serve --no-batching).")
    check_batchable(target_model, draft_model, tokenizer)


class BatchWorker(GenerationWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_batched(self.target_model, self.draft_model, self.tokenizer, self.options.tree)
        self.engine = self._new_engine()
        self._running: Dict[int, Running] = {}  # uid -> job state
        self.running = None  # (the one-at-a-time worker's field: /health reads it)

    def _new_engine(self) -> BatchEngine:
        return BatchEngine(self.target_model, self.draft_model,
                           max_draft_tokens=self.options.max_draft_tokens,
                           stop_tokens=self.tokenizer.eos_token_ids,
                           mtp_weights=self.options.mtp_weights)

    def cancel(self, job: Job) -> None:
        """A queued job leaves the queue now; a running one at the next round."""
        with self._lock:
            job.cancel()
            queued = job in self._pending
            if queued:
                self._pending.remove(job)
                self._admitted.discard(job)
        if queued:
            job.emit(Failed(503, CANCELLED))

    def _take(self) -> Optional[List[Job]]:
        """New jobs (waiting for one while nothing runs); None once the thread should end."""
        with self._ready:
            while not self._pending and not self.engine.busy:
                self.running = None
                self._ready.wait()
            jobs = list(self._pending)
            self._pending.clear()
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
                    logger.exception("batched generation failed")
                    self._fail_all(Failed(500, "Generation failed on the server; its log has "
                                               "the details."))
                    self.engine = self._new_engine()  # its rows were in the failed round
                    continue
                for out in outputs:
                    self._deliver(out)
            self._fail_all(Failed(503, CANCELLED))
        finally:
            mx.clear_streams()

    def _start_job(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, Failed(503, CANCELLED))
            return
        s, o = job.request.settings, self.options
        k = s.num_draft_tokens
        if k is None and o.adaptive is False:  # --fixed: the default k, as one at a time
            k = DEFAULT_NUM_DRAFT_TOKENS
        cache, cached = self._cache_for(job.prompt_ids)
        request = RowRequest(
            job.prompt_ids, job.max_tokens,
            SamplingConfig(temp=s.temp, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p),
            seed=s.seed, prompt_lookup=s.prompt_lookup, num_draft_tokens=k,
            logits_processors=tuple(_processors(s) or ()), logprobs=job.request.logprobs is not None,
            suffix=self.suffix.index_for(job.partition) if s.suffix else None,
            keep_cache=self.store is not None, prompt_lookup_max_ngram=o.prompt_lookup_max_ngram)
        try:
            uid = self.engine.insert(request, cache, cached)
        except ValueError as exc:
            self._end(job, Failed(400, str(exc)))
            return
        self._running[uid] = Running(job, uid, cached, self.tokenizer.detokenizer,
                                     StopMatcher(job.request.stop), [], [],
                                     StatsRecorder(len(job.prompt_ids), None,
                                                   rule_name(request.sampling)))

    def _cache_for(self, prompt_ids: List[int]):
        """(a stored cache and how many prompt tokens it holds), or (None, 0): the engine then
        makes the row's cache in its own kinds."""
        if self.store is None:
            return None, 0
        return self.store.take(prompt_ids)

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
        self._end(state.job, Finished(finish, len(state.job.prompt_ids), state.cached,
                                      len(state.tokens) - int(bool(eos_ended)),
                                      state.recorder.snapshot()))
        self._store(state, cache)

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
