"""Proposals from a draft model whose tokenizer differs from the target's.

The draft reads the target's text in its own vocabulary (`DraftText`, kept in step each
round) and drafts with one of two rules, both exact under the standard acceptance rule
(Timor et al., ICML 2025, "lossless speculative decoding for heterogeneous vocabularies"):

  "string"        the draft writes its own tokens; their text, read by the target's
                  tokenizer as the continuation of the history, is proposed with a one-hot q
                  (like prompt lookup: x is kept with probability p(x), else a token is drawn
                  from p without x). Exact at every temperature. One extra host sync a round:
                  the drafted ids must be read as text before the target can verify them.
  "intersection"  each step samples from the draft's distribution restricted to the tokens
                  both vocabularies share (same string), renormalised; the token is proposed
                  as its target twin, with q that distribution mapped to target ids and 0
                  elsewhere; the residual max(0, p - q) spans the whole target vocabulary.
                  Exact for any q, so at every temperature; no extra sync.

`rule="auto"` picks per round the rule whose recent rounds emitted more tokens per second
(what each round took from propose to commit), trying the other now and then. The choice
uses only finished rounds, never the round's own draws: it cannot change the output.

The draft cache holds `fed`, the draft ids it has seen; each proposal keeps the longest
prefix of `fed` that agrees with the draft's reading of the history and feeds the rest
(a key/value entry depends only on the ids before it), so a rejection, a re-read word or
tokens decoded while the draft was off all rewind the same way: a trim of host metadata.

A reused prompt cache (target layers, then the draft's): `context` is the target tokens the
call's cache held before it (session.held_tokens), read before the call's own; the draft's
layers carry `fed` on their first layer (FED), so the next call keeps the prefix of it that
still agrees and feeds only the rest. Without either it re-reads from the call's first token.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..attention import round_attention
from ..cache import ModelCache, make_cache
from ..cache.prefill import prefill
from ..cache.rewind import MARK
from ..sampling import SamplingConfig, keyed_categorical, logprobs_from_logits, sample
from .cross_text import DraftText, target_continuation
from .draft_model import CATCH_UP_SPLIT
from .protocol import Proposal, point_mass_proposal
from .vocab_bridge import VocabBridge

RULES = ("string", "intersection")
DEFAULT_RULE = "auto"  # "string" or "intersection" pins one (a study flips it)
EXPLORE_EVERY = 8  # rounds of one rule after which "auto" tries the other once
RATE_MEMORY = 0.7  # weight of the past in each rule's tokens-per-second estimate
MAX_STEPS_PER_TOKEN = 2.0  # the string rule drafts at most this many steps per target token
FED = MARK + "draft_ids"  # on a reused cache's first draft layer: the draft ids it holds


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CrossTokenizerDrafter:
    source = "draft"  # to the policy it is the draft model
    prefills_later = True  # the loop may prefill it when the policy first asks

    def __init__(self, draft_model, bridge: VocabBridge, sampling: SamplingConfig,
                 target_vocab_size: int, draft_vocab_size: int, cache=None,
                 rule: Optional[str] = None, context: Optional[List[int]] = None,
                 next_key: Optional[Callable[[], mx.array]] = None):
        rule = rule or DEFAULT_RULE
        if rule not in RULES + ("auto",):
            raise ValueError(f'rule must be "auto", "string" or "intersection", got {rule!r}.')
        self.draft_model = draft_model
        self.draft = ModelCache(draft_model,
                                cache if cache is not None else make_cache(draft_model))
        if self.draft.has_recurrent:
            raise ValueError("A draft with recurrent state (a hybrid or SSM model) cannot draft "
                             "across tokenizers yet; choose an attention-only draft model.")
        self.bridge = bridge
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.rule = rule
        self.next_key = next_key  # a sampled draw's random key (a batch row's); None: MLX's global
        self.text = DraftText(bridge)
        self.context = list(context or [])  # target tokens before the call's (a reused cache)
        self.fed: List[int] = []  # the draft ids the draft cache holds
        # Twins within both models' logits (a tokenizer may hold ids past them, or fewer)
        rows = draft_vocab_size
        twins = np.full(rows, -1, np.int64)
        known = min(rows, bridge.draft.size)
        twins[:known] = bridge.draft_to_target[:known]
        twins[twins >= target_vocab_size] = -1
        self._twins = twins
        self._shared = mx.array(twins >= 0)  # (V_d,) the draft tokens with a target twin
        self._to_target = mx.array(np.maximum(twins, 0).astype(np.uint32))  # (V_d,)
        # q mapped to target ids: target id -> its draft twin's column, or the zero column
        back = np.full(target_vocab_size, rows, np.int64)
        shared = np.nonzero(twins >= 0)[0]
        back[twins[shared]] = shared
        self._q_index = mx.array(back.astype(np.uint32))  # (V_t,)
        self._rates: Dict[str, Optional[float]] = dict.fromkeys(RULES)  # tokens per second
        self._streak = 0  # rounds since "auto" last tried the other rule
        self._round = None  # (rule, started) of the proposal awaiting commit
        self._pending = None  # an intersection round's drafted ids (lazy) until commit
        self._next: List[int] = []  # the id after `fed` that the next step feeds

    # --- keeping the draft's own text in step -------------------------------------------

    def prefill(self, prompt: List[int], step_size: int, progress=None,
                look_rows: int = 0) -> None:
        want = self.text.update(self._whole(prompt))
        keep = min(_common_prefix(self._held(), want), max(len(want) - 1, 0))
        self.draft.restore_length(keep)
        prefill(self.draft, want[keep:-1], step_size, progress)
        self.fed, self._next = want[:-1], want[-1:]
        self._mark()

    def _whole(self, history: List[int]) -> List[int]:
        """The target's text this call drafts after: a reused cache's earlier tokens, then
        the call's own."""
        return self.context + history if self.context else history

    def _held(self) -> List[int]:
        """The draft ids a reused draft cache holds, as the call that left it recorded
        them ([] when unknown: then it is re-read from the start)."""
        held = getattr(self.draft.layers[0], FED, None) if self.draft.layers else None
        if not isinstance(held, list) or len(held) != self.draft.length or None in held:
            return []
        return held

    def _mark(self) -> None:
        """Record on the draft's first layer which ids it holds (for a reused cache's next
        call)."""
        if self.draft.layers:
            setattr(self.draft.layers[0], FED, self.fed)

    def _catch_up(self, history: List[int]) -> Optional[mx.array]:
        """Rewind the draft cache to what still agrees with its reading of the history, feed
        the rest; the logits after the history (V_d,), lazy; None when the history ends inside
        a character."""
        history = self._whole(history)
        want = self.text.update(history)
        if self.text.covered < len(history) or not want:
            return None
        keep = min(_common_prefix(self.fed, want), len(want) - 1)
        self.draft.restore_length(keep)
        unseen = want[keep:]
        if len(unseen) > CATCH_UP_SPLIT:  # a backlog: no output layer over it (DraftModelDrafter)
            self.draft.forward(mx.array(unseen[:-1], mx.uint32))  # logits never evaluated
            unseen = unseen[-1:]
        logits = self.draft.forward(mx.array(unseen, mx.uint32))[-1]  # (V_d,)
        self.fed = list(want)  # (a round's drafts join it in place: see _draft, _settle)
        self._mark()
        return logits

    def can_propose(self, history: List[int]) -> bool:
        return not self.text.lagging(self._whole(history))

    def step_seconds(self, token: int, repeats: int = 2) -> float:
        """Seconds of one draft step after the prompt, undone each time (the fastest of
        `repeats`)."""
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(self.draft.forward(mx.array(self._next or [0], mx.uint32))[-1])
            fastest = min(fastest, time.perf_counter() - start)
            self.draft.restore_length(self.draft.length - 1)
        return fastest

    # --- one round ------------------------------------------------------------------------

    def propose(self, history: List[int], k: int) -> Optional[Proposal]:
        logits = self._catch_up(history)
        if logits is None:
            return None
        rule = self._choose()
        self._round = (rule, time.perf_counter())
        if rule == "intersection":
            return self._intersection(logits, k)
        return self._string(history, logits, k)

    def _draft(self, logits: mx.array, steps: int, shared_only: bool):
        """`steps` draft tokens (each (1,), lazy), each step's log q (V_d,) and its logits."""
        tokens, logprobs, raw = [], [], []
        with round_attention():
            for i in range(steps):
                if i:
                    logits = self.draft.forward(tokens[-1])[-1]  # (V_d,)
                raw.append(logits)
                if shared_only:
                    logits = mx.where(self._shared, logits, -mx.inf)
                logq = logits if self.sampling.greedy else \
                    logprobs_from_logits(logits, self.sampling)  # (V_d,) the same transform as p
                tokens.append(self._sample(logq))  # (1,)
                logprobs.append(logq)
                mx.async_eval(tokens[-1])
        self.fed += [None] * (steps - 1)  # fed, values known after the sync; see _settle
        return tokens, logprobs, raw

    def _sample(self, logq: mx.array) -> mx.array:
        """One draft (1,) from log q (V_d,): with the caller's key when it gave `next_key`."""
        if self.next_key is None or self.sampling.greedy:
            return sample(logq, self.sampling)[None]
        return keyed_categorical(logq, self.next_key()).astype(mx.uint32)[None]

    def _intersection(self, logits: mx.array, k: int) -> Proposal:
        tokens, logprobs, raw = self._draft(logits, k, shared_only=True)
        drafted = mx.concatenate(tokens)  # (k,) draft ids
        probs = None
        if not self.sampling.greedy:
            q = self._intersection_q(logprobs, raw)  # (k, V_d), 0 off the shared tokens
            q = mx.concatenate([q, mx.zeros((k, 1), q.dtype)], axis=1)  # (k, V_d + 1)
            probs = mx.take(q, self._q_index, axis=1)  # (k, V_t): each target id's twin's q
        self._pending = drafted
        return Proposal(self._to_target[drafted], probs, self.source, self,
                        cross_rule="intersection")

    def _intersection_q(self, logprobs: List[mx.array], raw: List[mx.array]) -> mx.array:
        """q: the distributions the drafts were drawn from, restricted to the shared tokens
        and renormalised (the test's negative control returns the unrestricted ones)."""
        return mx.exp(mx.stack(logprobs))

    def _string(self, history: List[int], logits: mx.array, k: int) -> Optional[Proposal]:
        history = self._whole(history)
        ratio = len(self.fed) / max(len(history), 1)  # draft tokens per target token so far
        steps = max(1, min(math.ceil(k * MAX_STEPS_PER_TOKEN), math.ceil(k * ratio)))
        tokens, logprobs, _ = self._draft(logits, steps, shared_only=False)
        drafted = mx.concatenate(tokens).tolist()  # the rule's own sync: text before verifying
        self._pending = None
        self._settle(drafted)
        found = target_continuation(self.bridge, history, drafted)[:k]
        outside = [i for i, t in enumerate(found) if t >= self.target_vocab_size]
        found = found[:outside[0]] if outside else found  # (an added token past its logits)
        if not found:
            self._round = None
            return None
        proposal = point_mass_proposal(found, self.target_vocab_size, self.sampling.greedy,
                                       self.source, self)
        proposal.probs = self._string_q(proposal, logprobs)
        proposal.cross_rule = "string"
        return proposal

    def _string_q(self, proposal: Proposal, logprobs: List[mx.array]) -> Optional[mx.array]:
        """q: one-hot on each proposed token (None when greedy), exact at every temperature
        (the test's negative control returns the draft's own distributions instead)."""
        return proposal.probs

    def _settle(self, drafted: List[int]) -> None:
        """Put the drafted ids' values where `_draft` left placeholders (all but the last
        drafted id were fed)."""
        fed = len(drafted) - 1
        if fed:
            self.fed[-fed:] = drafted[:-1]

    def commit(self, num_accepted: int) -> None:
        """Nothing to rewind now: the next proposal keeps what agrees with the history. The
        rule's rate is updated with this round's time and tokens."""
        if self._pending is not None:  # (intersection: the drafted values, now computed)
            self._settle(self._pending.tolist())
            self._pending = None
        if self._round is None:
            return
        rule, started = self._round
        self._round = None
        rate = (num_accepted + 1) / max(time.perf_counter() - started, 1e-9)
        old = self._rates[rule]
        self._rates[rule] = rate if old is None else RATE_MEMORY * old + (1 - RATE_MEMORY) * rate

    def _choose(self) -> str:
        """The rule with the better rate so far (the opening one before any), the other once
        after EXPLORE_EVERY rounds of it."""
        if self.rule != "auto":
            return self.rule
        known = [r for r in RULES if self._rates[r] is not None]
        opening = "string" if self.sampling.greedy else "intersection"
        best = max(known, key=lambda r: self._rates[r]) if known else opening
        self._streak += 1
        if self._streak > EXPLORE_EVERY:
            self._streak = 0
            return RULES[1 - RULES.index(best)]
        return best

