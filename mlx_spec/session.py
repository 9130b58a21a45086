"""One generation call's caches: what they hold while tokens are handed out, and after.

The prompt-cache contract (mlx-lm's): a reused `prompt_cache` holds the
prompt and every token the caller was given, including the last (and the
EOS when generation stopped on it), and never a rejected draft. It holds
at every point the caller can stop at: after the last response, when the
caller breaks out of the loop (with or without closing the generator), or
when an exception is raised inside the caller's loop.

`hold(n)` makes the caches show the first n tokens of the call while a
response is out (attention layers: a trim, taken back by `release()`);
`settle(seen)` makes them hold exactly `seen` for good.

Without holds (`stream_generate(..., prompt_cache_live=False)`) the caches
are settled when the generator ends or is closed, or, for a generator left
open, by the next call that takes the cache over (`hand_over`), so a
conversation stays right whatever the caller does with the generator.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx

from .cache import ModelCache

OWNER = "_mlx_spec_owner"  # on the first layer of a reused prompt cache: its latest call's Session


@dataclass
class Session:
    target: ModelCache
    draft: Optional[object]  # the DraftModelDrafter, if any
    start: int  # tokens the target cache held before this call
    prompt_cache: Optional[list] = None  # the caller's list, when reused
    seen: Optional[List[int]] = None  # this call's prompt + tokens handed out, once it started
    _held: List = field(default_factory=list)

    def __post_init__(self):
        if self.prompt_cache:  # the latest call owns the caller's cache
            setattr(self.prompt_cache[0], OWNER, weakref.ref(self))

    @property
    def owns_cache(self) -> bool:
        """False once a later call took the caller's prompt cache over."""
        if not self.prompt_cache:
            return True
        owner = getattr(self.prompt_cache[0], OWNER, None)
        return isinstance(owner, weakref.ref) and owner() is self

    def hand_over(self) -> None:
        """A later call takes the cache: leave it holding what this call handed out, if it
        started and was never settled (a generator left open)."""
        if self.seen is not None and self.owns_cache:
            self.settle(self.seen)

    def hold(self, seen: List[int]) -> None:
        """Show `seen` (this call's tokens so far) while a response is out; `release()` takes it back."""
        undos = [self.target.peek(self.start + len(seen))]
        if self.draft is not None:
            undos.append(self.draft.peek(seen, len(seen)))
        self._held = [undo for undo in undos if undo is not None]

    def release(self) -> None:
        if not self.owns_cache:
            self._held = []
            raise ValueError("This generation's prompt_cache was used by a later call since, so "
                             "it cannot continue; start a new call with the cache.")
        for undo in self._held:
            undo()
        self._held = []

    def settle(self, seen: List[int]) -> None:
        """Leave the caches holding exactly `seen` (this call's prompt + every token handed out)."""
        if not self.owns_cache:  # a later call has the cache now: leave it alone
            self._held = []
            return
        self.release()
        target = self.target
        wanted = self.start + len(seen)
        if target.length > wanted:
            point = target.point_at(wanted) if target.has_recurrent else None
            if point is not None:  # before a queued plain step
                target.restore(point)
            elif target.has_recurrent:  # inside the current round
                target.keep(wanted - target.anchor_length)
            else:
                target.restore_length(wanted)
        if target.length < wanted:
            target.forward(mx.array(seen[target.length - self.start:], mx.uint32))
        mx.eval([c.state for c in target.layers])
        if self.draft is not None:
            self.draft.settle(seen, len(seen))
        self.seen = None  # settled: nothing for a later call to finish


def take_over(prompt_cache: Optional[list]) -> None:
    """Before a call reads a reused cache: its previous call, if still open and unsettled,
    leaves it holding what that call handed out."""
    owner = getattr(prompt_cache[0], OWNER, None) if isinstance(prompt_cache, list) and \
        prompt_cache else None
    earlier = owner() if isinstance(owner, weakref.ref) else None
    if earlier is not None:
        earlier.hand_over()
