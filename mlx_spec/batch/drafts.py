"""The draft model for a batch: every row drafts k tokens in the same k one-position passes.

Each row's draft cache holds its history but for `Row.draft_pending`, the
tokens it has not seen (the last emitted token; also the last draft when all
were kept; everything a round emitted while another source proposed for the
row). The first pass feeds every row its pending tokens, right-padded to the
longest and rolled into place afterwards, and reads each row's logits at its
own last pending token; the next k - 1 passes feed one draft each. Drafts are
drawn with each row's own sampling transform and random key, so q is the
distribution each row's tokens were really drawn from.

A draft with recurrent state (a Gated DeltaNet, short-convolution or Mamba-2 hybrid, as
the target's families in kv.py) batches too: its first pass, where rows' pending tokens
differ in number, is taken back past each row's own end as a verify pass is (restored and
replayed: `BatchCache.undoable` and `keep`); the chain's one-position passes keep a
reference to the states after each, and each row takes the one after its kept drafts
(`BatchCache.pick_states`: a gather, no replay).

A confidence stop (`confidence` > 0, as a call's `draft_confidence`): a row's chain ends at
the first draft whose top probability under the row's sampling is below it, that draft kept
(`cut`), as the one-row drafter's; the chain goes on while any row is still sure, and its
steps read the rows' top probabilities on the host, as the one-row drafter's do.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..attention import round_attention
from ..drafters.chain import draft_chain
from ..mtp.heads import split_target
from ..sampling import keyed_categorical, logprobs_from_logits, sample
from .kv import BatchCache, row_cache
from .solo import SoloCache
from .rows import Row


class BatchDraft:
    source = "draft"

    def __init__(self, draft_model, target_vocab_size: int, confidence: float = 0.0,
                 solo: bool = False):
        # (`solo`: one row at a time on the draft's own cache kinds, batch/solo.py)
        self.cache = SoloCache(draft_model) if solo else BatchCache(draft_model)
        self.confidence = confidence
        self.cut: List[int] = []  # each row's drafts before its confidence stop (the last proposal)
        self.model = draft_model
        self.target_vocab_size = target_vocab_size
        self.fed = 0  # positions the last proposal fed after the pending ones (k - 1)
        try:  # head(trunk(x)) == draft_model(x)
            self.split = split_target(draft_model)
        except (AttributeError, KeyError, TypeError):  # not mlx-lm's trunk-and-head layout
            self.split = None
        self.keep_logits = False  # True: each proposal's per-step logits in kept_logits
        self.kept_logits: Optional[mx.array] = None  # (B, k, V_d) of the last proposal, lazy
        self.states: list = []  # recurrent layers: their states after each position of the chain

    def ready(self, row: Row) -> bool:
        return True  # its cache holds the prompt from the start

    def step_seconds(self, row: Row, repeats: int = 2) -> float:
        """Seconds of one draft step on the row's last token on an empty one-row cache, the
        fastest of `repeats`: what each drafted token costs, for a row alone's policy before
        its first round (as the one-row drafter's step, timed before its lazy prefill)."""
        x = mx.array([row.history[-1:]], mx.uint32)
        fastest = float("inf")
        for _ in range(repeats):
            layers = row_cache(self.model)
            start = time.perf_counter()
            mx.eval(self.model(x, cache=layers)[:, -1])
            fastest = min(fastest, time.perf_counter() - start)
        return fastest

    def propose(self, rows: Sequence[Row], k: int,
                drawn: Sequence[int]) -> Tuple[mx.array, List[Optional[mx.array]]]:
        """Drafts (B, k) and, per sampled row, q (drawn[i], V) (None for greedy rows); lazy.

        Row i draws its first `drawn[i]` drafts with its own sampling and key (the drafts it
        proposes) and takes the argmax for the rest (never proposed), so its random stream
        does not depend on how many drafts the other rows want. With a confidence stop the
        chain may end early, and row i proposes only its first `cut[i]` drafts."""
        pending = [row.draft_pending for row in rows]
        lengths = [len(p) for p in pending]
        width = max(lengths)
        x = mx.array([p + [0] * (width - len(p)) for p in pending], mx.uint32)  # (B, P)
        layers = self.cache.layers
        last = mx.array([n - 1 for n in lengths])[:, None, None]
        # Recurrent layers take the filler in too: the forward is undone past each row's end
        ragged = self.cache.undoable(width) if min(lengths) < width else nullcontext()
        with round_attention():
            with ragged:
                if width == 1:
                    logits = self.model(x, cache=layers)[:, -1]  # (B, V_d)
                elif self.split is None:  # a catch-up: every position's logits, the last kept
                    logits = mx.take_along_axis(self.model(x, cache=layers), last, axis=1)[:, 0]
                else:  # the output layer only at each row's last pending token (a catch-up)
                    trunk, head = self.split
                    hidden = trunk(x, cache=layers)  # (B, P, H)
                    logits = head(mx.take_along_axis(hidden, last, axis=1)[:, 0])  # (B, V_d)
            self.cache.keep(width, lengths)  # each row's entries end where the others' do
            recurrent = bool(self.cache.recurrent)
            self.states = [self.cache.states()]  # recurrent: after each draft fed (settle)
            probs, kept = [[] for _ in rows], []
            # A row's logits processors see its text and its drafts so far, as the target's
            # verify pass hands them over (a draft of the target's vocabulary)
            seen = {i: mx.array(row.history, mx.uint32) for i, row in enumerate(rows)
                    if row.request.logits_processors} \
                if logits.shape[-1] == self.target_vocab_size else {}

            last = []  # the logits of the last drafts drawn (a confidence stop reads them)
            self.cut = list(drawn)

            def draw(logits: mx.array, i: int) -> mx.array:
                if seen:
                    logits = processed_rows(rows, logits, seen)
                if self.keep_logits:  # (a token tree's siblings: batch/trees.py)
                    kept.append(logits)
                last[:] = [logits]
                y = draw_rows(rows, logits, probs, [i < n for n in self.cut])  # (B,)
                for j in seen:
                    seen[j] = mx.concatenate([seen[j], y[j:j + 1]])
                mx.async_eval(y)
                return y

            def feed(y: mx.array) -> mx.array:
                logits = self.model(y[:, None], cache=layers)[:, -1]
                if recurrent:
                    self.states.append(self.cache.states())
                return logits

            more = (lambda i: self._still_sure(rows, last[0], i)) if self.confidence else None
            tokens = draft_chain(logits, k, feed, draw, more)
        self.fed = len(tokens) - 1
        self.kept_logits = mx.stack(kept, axis=1) if kept else None
        q = [mx.stack(p) if p else None for p in probs]
        pad = self.target_vocab_size - logits.shape[-1]
        if pad > 0:  # a draft vocabulary padded shorter than the target's
            q = [None if p is None else mx.pad(p, [(0, 0), (0, pad)]) for p in q]
        return mx.stack(tokens, axis=1), q

    def _still_sure(self, rows: Sequence[Row], logits: mx.array, i: int) -> bool:
        """After draft i (0-based): cut each row still drafting whose draft was drawn with a top
        probability below the confidence (one host sync); whether any row drafts on."""
        going = [j for j, n in enumerate(self.cut) if n > i]
        if not going:
            return False
        tops = mx.stack([mx.max(logprobs_from_logits(logits[j], rows[j].request.sampling))
                         for j in going])
        for j, top in zip(going, mx.exp(tops).tolist()):  # (the one-row drafter's test)
            if top < self.confidence:
                self.cut[j] = i + 1
        return any(self.cut[j] > i + 1 for j in going)

    def settle(self, rows: Sequence[Row], ran: bool, kept_drafts: Sequence[int],
               emitted: Sequence[List[int]]) -> None:
        """After verification: row i keeps `kept_drafts[i]` of the draft model's own drafts
        (0 when another source proposed for it) and emitted `emitted[i]`."""
        if not ran:
            for row, tokens in zip(rows, emitted):
                row.draft_pending = row.draft_pending + tokens
            return
        keep = [min(n, self.fed) for n in kept_drafts]
        self.cache.keep(self.fed, keep)
        if self.cache.recurrent:  # one state a position: each row's, after its kept drafts
            self.cache.pick_states(self.states, keep)
        self.states = []
        for row, n, tokens in zip(rows, keep, emitted):
            row.draft_pending = tokens[n:]


def processed_rows(rows: Sequence[Row], logits: mx.array, seen: dict) -> mx.array:
    """Draft logits (B, V) with row j's processors applied where `seen` has its tokens so far."""
    out = []
    for j, row in enumerate(rows):
        row_logits = logits[j:j + 1]
        for processor in row.request.logits_processors if j in seen else ():
            row_logits = processor(seen[j], row_logits)
        out.append(row_logits)
    return mx.concatenate(out)


def draw_rows(rows: Sequence[Row], logits: mx.array, probs: list, sampled) -> mx.array:
    """One draft per row from logits (B, V): the argmax, or for a sampled row with
    `sampled[i]` a draw with its own sampling and key, or its opaque sampler (its q appended
    to `probs[i]`)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)  # (B,)
    if all(row.greedy or not s for row, s in zip(rows, sampled)):
        return greedy
    drawn = []
    for i, row in enumerate(rows):
        if row.greedy or not sampled[i]:
            drawn.append(greedy[i])
            continue
        logprobs = logprobs_from_logits(logits[i], row.request.sampling)  # (V_d,)
        probs[i].append(mx.exp(logprobs))
        if row.sampler is not None:  # drawn as the target's tokens will be (as a call's draft)
            drawn.append(sample(logprobs[None], row.request.sampling)[0])
        else:
            drawn.append(keyed_categorical(logprobs, row.next_key()).astype(mx.uint32))
    return mx.stack(drawn)
