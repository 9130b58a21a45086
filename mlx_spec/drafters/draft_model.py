"""Proposals from a small draft model, k serial steps, each queued with async_eval.

The draft cache holds a prefix of the shared history; `propose` first feeds
whatever it has not seen (the last emitted token, plus the last draft token
when all k were accepted, or everything generated while another drafter
proposed), then drafts k tokens. Nothing here waits for the device.

Rewinding after verification: attention layers are trimmed; a draft with
recurrent state (a hybrid or SSM draft) keeps a checkpoint after each of its
one-token steps (references to the state arrays, free) and goes back to the
one at the accepted length, so it never replays anything.
"""

from __future__ import annotations

import time
from typing import List

import mlx.core as mx

from ..attention import round_attention
from ..cache import ModelCache, make_cache
from ..cache.prefill import prefill
from ..prompt_look import drop_hidden, keep_hidden, tail_logits
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .chain import draft_chain
from .protocol import Proposal


# Catching up on more unseen tokens than this (decoded while the draft was off
# or another source proposed), the draft feeds all but the last in a pass of
# their own whose logits nothing reads, so the output layer runs for one
# position instead of all: it is ~45% of the shipped draft's work per token.
CATCH_UP_SPLIT = 4


class DraftModelDrafter:
    source = "draft"
    prefills_later = True  # the loop may prefill it when the policy first asks (catches up)
    keep_logprobs = False  # True: each proposal's per-step log q (or logits, greedy) in kept_logprobs

    def __init__(self, draft_model, sampling: SamplingConfig, target_vocab_size: int,
                 cache=None, confidence: float = 0.0, processors=None):
        self.draft_model = draft_model
        self.draft_cache = cache if cache is not None else make_cache(draft_model)
        self.draft = ModelCache(draft_model, self.draft_cache)
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.confidence = confidence
        # The caller's logits processors, applied to the draft's logits as to the target's
        # (not needed for exactness: for acceptance, when they move the distribution a lot).
        self.processors = tuple(processors or ())
        self.cached = 0  # how many history tokens the draft cache holds
        self._proposed_at = 0
        self._start = None
        self._steps = []  # checkpoints after each draft step (recurrent drafts only)
        self._ahead = None  # (undo, tokens) of a lazy forward shown to the caller, see peek()
        self._prompt_tail = None  # the prefill's last logits, for the prompt look

    def prefill(self, prompt: List[int], step_size: int, progress=None,
                look_rows: int = 0) -> None:
        """Process all prompt tokens but the last, in chunks. `look_rows` > 0: keep the logits
        of the last ones for `prompt_logits` (the prompt look)."""
        self.drop_look_ahead()
        split = look_rows > 0 and keep_hidden(self.draft)
        prefill(self.draft, prompt[:-1], step_size, progress, tail=look_rows if split else 0)
        self.cached = len(prompt) - 1
        self._prompt_tail = tail_logits(self.draft, look_rows) if look_rows > 0 else None
        if split:
            drop_hidden(self.draft)

    def prompt_logits(self, rows: int):
        """Its logits at the prefill's last r <= `rows` positions, once, as a prompt_look.Tail
        (its output layer runs only over the rows the look asks for); or None."""
        tail, self._prompt_tail = self._prompt_tail, None
        return None if tail is None else tail.at_most(rows)

    def step_seconds(self, token: int, repeats: int = 2) -> float:
        """Seconds of one draft step on `token` after what the cache holds, undone each time;
        the fastest of `repeats` (a stall in one would read as a costly draft): what each
        drafted token costs, known before any round (host syncs of its own)."""
        self.drop_look_ahead()
        point = self.draft.checkpoint()
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(self.draft.forward(mx.array([token], mx.uint32))[-1])
            fastest = min(fastest, time.perf_counter() - start)
            self.draft.restore(point)
        return fastest

    def can_propose(self, history: List[int]) -> bool:
        return True  # a model always has a guess

    def propose(self, history: List[int], k: int) -> Proposal:
        self.drop_look_ahead()
        self._steps = []
        self._start = (self.draft.checkpoint(), self.cached)  # for settle() after a break
        unseen = history[self.cached:]
        if len(unseen) > CATCH_UP_SPLIT:  # after an off period: no output layer over the backlog
            self.draft.forward(mx.array(unseen[:-1], mx.uint32))  # its logits are never evaluated
            unseen = unseen[-1:]
        draft_probs, kept, last = [], [], []
        seen = mx.array(history, mx.uint32) if self.processors else None

        def step(y: mx.array) -> mx.array:
            """Feed `y` (tokens the draft has not seen): its logits (V_d,) after the last."""
            nonlocal seen
            draft_logits = self.draft.forward(y)[-1]  # (V_d,)
            if seen is not None and draft_logits.shape[-1] == self.target_vocab_size:
                if last:  # y is a draft (not the history's unseen tail): processors see it
                    seen = mx.concatenate([seen, y])
                for processor in self.processors:
                    draft_logits = processor(seen, draft_logits[None])[0]
            if self.draft.has_recurrent:
                self._steps.append(self.draft.checkpoint())
            return draft_logits

        def draw(draft_logits: mx.array, i: int) -> mx.array:
            # Greedy needs only the argmax, which the (monotone) log-softmax keeps.
            draft_logprobs = (draft_logits if self.sampling.greedy and not self.confidence
                              else logprobs_from_logits(draft_logits, self.sampling))
            y = sample(draft_logprobs, self.sampling)[None]  # (1,)
            if self.keep_logprobs:  # (a token tree's siblings: drafters/tree.py)
                kept.append(draft_logprobs)
            if not self.sampling.greedy:
                draft_probs.append(mx.exp(draft_logprobs))
            mx.async_eval(y, *draft_probs[-1:])
            last[:] = [draft_logprobs]
            return y

        with round_attention():  # once per proposal: the first pass catches up on 1..k+1 tokens
            draft_tokens = draft_chain(
                step(mx.array(unseen, mx.uint32)), k, step, draw,
                more=(lambda i: not self._unsure(last[0])) if self.confidence else None)
        # The cache now holds history + all drafts but the last (which is unseen).
        self._proposed_at = len(history)
        self.cached = len(history) + len(draft_tokens) - 1
        self.kept_logprobs = mx.stack(kept) if kept else None  # (k, V_d)
        probs = None
        if draft_probs:
            probs = mx.stack(draft_probs)  # (k, V_d)
            pad = self.target_vocab_size - probs.shape[-1]
            if pad > 0:  # draft vocab padded shorter than the target's
                probs = mx.pad(probs, [(0, 0), (0, pad)])
        return Proposal(mx.concatenate(draft_tokens), probs, self.source, self)

    def _unsure(self, draft_logprobs) -> bool:
        """Confidence stop: the draft's top probability is below the threshold (a host sync)."""
        return mx.exp(mx.max(draft_logprobs)).item() < self.confidence

    def commit(self, num_accepted: int) -> None:
        self.drop_look_ahead()
        keep = min(self.cached, self._proposed_at + num_accepted)
        if self._steps:  # step j's checkpoint holds history + j drafts
            self.draft.restore(self._steps[keep - self._proposed_at])
        else:
            self.draft.restore_length(self.draft.length - (self.cached - keep))
        self.cached = keep

    def peek(self, history: List[int], num_tokens: int, upcoming: List[int] = ()):
        """Show only history[:num_tokens] until the returned undo is called (None: nothing to do).

        A draft that trails (it catches up at its next proposal) is shown the
        missing tokens, and `upcoming` (the ones the caller gets next), by one
        lazy forward, which later responses of the round trim: never computed
        unless the cache is read meanwhile, and dropped before the draft is
        used again.
        """
        extra = self.cached - num_tokens
        if extra < 0:
            return self._look_ahead(history[self.cached:num_tokens], list(upcoming))
        self.drop_look_ahead()
        if extra == 0:
            return None
        if not self._steps:
            if self.draft.has_recurrent:
                return None
            self.draft.restore_length(self.draft.length - extra)
            return lambda: self.draft.untrim(extra)
        step = num_tokens - self._proposed_at
        if step < 0:
            return None
        now = self._steps[self.cached - self._proposed_at]
        self.draft.restore(self._steps[step])
        return lambda: self.draft.restore(now)

    def _look_ahead(self, missing: List[int], upcoming: List[int]):
        fed = self._ahead[1] if self._ahead is not None else []
        if self.draft.has_recurrent or fed[:len(missing)] != missing:  # (recurrent: no trims)
            self.drop_look_ahead()
            fed = missing + ([] if self.draft.has_recurrent else upcoming)
            self._ahead = (self.draft.look_ahead(mx.array(fed, mx.uint32)), fed)
        extra = len(fed) - len(missing)
        if extra == 0:
            return None
        self.draft.restore_length(self.draft.length - extra)
        return lambda: self.draft.untrim(extra)

    def drop_look_ahead(self) -> None:
        """Undo what `peek` showed a trailing draft (before anything feeds the draft)."""
        if self._ahead is not None:
            self._ahead[0]()
            self._ahead = None

    def settle(self, history: List[int], num_tokens: int) -> None:
        """Make the draft cache hold exactly history[:num_tokens] (end of a call)."""
        self.drop_look_ahead()
        if self.cached > num_tokens and self.draft.has_recurrent and self._start:
            point, self.cached = self._start  # before the last proposal: a prefix of the wanted
            self.draft.restore(point)
        if self.cached > num_tokens:
            self.draft.restore_length(self.draft.length - (self.cached - num_tokens))
        elif self.cached < num_tokens:
            self.draft.forward(mx.array(history[self.cached:num_tokens], mx.uint32))
        self.cached = num_tokens
