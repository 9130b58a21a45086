"""Proposals from a small draft model, k serial steps, each queued with async_eval.

The draft cache holds a prefix of the shared history; `propose` first feeds
whatever it has not seen (the last emitted token, plus the last draft token
when all k were accepted, or everything generated while another drafter
proposed), then drafts k tokens. Nothing here waits for the device.
"""

from __future__ import annotations

from typing import List

import mlx.core as mx

from ..attention import round_attention
from ..cache import make_cache, rewind
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from . import Proposal


class DraftModelDrafter:
    source = "draft"

    def __init__(self, draft_model, sampling: SamplingConfig, target_vocab_size: int,
                 cache=None, confidence: float = 0.0):
        self.draft_model = draft_model
        self.draft_cache = cache if cache is not None else make_cache(draft_model)
        self.sampling = sampling
        self.target_vocab_size = target_vocab_size
        self.confidence = confidence
        self.cached = 0  # how many history tokens the draft cache holds
        self._proposed_at = 0

    def prefill(self, prompt: List[int], step_size: int, progress=None) -> None:
        """Process all prompt tokens but the last, in chunks."""
        from ..loop import prefill

        prefill(self.draft_model, self.draft_cache, prompt[:-1], step_size, progress)
        self.cached = len(prompt) - 1

    def propose(self, history: List[int], k: int) -> Proposal:
        y = mx.array(history[self.cached:], mx.uint32)  # tokens the draft has not seen
        draft_tokens, draft_probs = [], []
        with round_attention():  # once per proposal: the first pass catches up on 1..k+1 tokens
            for i in range(k):
                draft_logits = self.draft_model(y[None], cache=self.draft_cache)[0, -1]  # (V_d,)
                draft_logprobs = logprobs_from_logits(draft_logits, self.sampling)
                y = sample(draft_logprobs, self.sampling)[None]  # (1,)
                if self.sampling.greedy:
                    mx.async_eval(y)
                else:
                    draft_probs.append(mx.exp(draft_logprobs))
                    mx.async_eval(y, draft_probs[-1])
                draft_tokens.append(y)
                if self.confidence and i + 1 < k and self._unsure(draft_logprobs):
                    break
        # The cache now holds history + all drafts but the last (which is unseen).
        self._proposed_at = len(history)
        self.cached = len(history) + len(draft_tokens) - 1
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
        keep = min(self.cached, self._proposed_at + num_accepted)
        rewind(self.draft_cache, self.cached - keep)
        self.cached = keep
