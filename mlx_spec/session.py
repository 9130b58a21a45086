"""One generation call's caches: what they hold while tokens are handed out, and after.

The prompt-cache contract (mlx-lm's): a reused `prompt_cache` holds the
prompt and every token the caller was given, including the last (and the
EOS when generation stopped on it), and never a rejected draft. It holds
at every point the caller can stop at: after the last response, when the
caller breaks out of the loop (with or without closing the generator), or
when an exception is raised inside the caller's loop.

`hold(seen, upcoming)` makes the caches show this call's tokens so far while
a response is out, and `release()` takes it back: trims of what the caches
computed ahead, and, for what they have not computed (a draft that sat out
while prompt lookup proposed, the call's last token), lazy forwards whose
undo drops them, so nothing is computed unless the cache is read meanwhile.
The only other cost: the last token of a round that the target cache lacks
is handed out after the next round, whose verify pass feeds it.
`settle(seen)` makes the caches hold exactly `seen` for good, once the stream
stops (exhausted, closed, collected, an exception), lazily: what it feeds is
computed by the cache's next use. It also records the tokens on the cache, so
the next call's prompt lookup can search the earlier turns (`held_tokens`), and
puts mlx-lm's own classes back in the caller's list (the rewindable sliding
windows a call runs on become RotatingKVCache again, lazily), so that mlx-lm's
`save_prompt_cache` / `load_prompt_cache` and generation take it.

Without holds (`stream_generate(..., prompt_cache_live=False)`) the caches
show nothing while a response is out; they are settled when the generator
ends or is closed, or, for a generator left open, by the next call that takes
the cache over (`hand_over`), so a conversation stays right whatever the
caller does with the generator.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx

from .cache import ModelCache
from .cache.rewind import MARK, make_plain

OWNER = MARK + "owner"  # on the first layer of a reused prompt cache: its latest call's Session
TOKENS = MARK + "tokens"  # on the same layer: the tokens the cache holds, when a call left it
CONTEXT = MARK + "context"  # on the same layer: a block drafter's context for those tokens


@dataclass
class Session:
    target: ModelCache
    draft: Optional[object]  # the DraftModelDrafter or DFlashDrafter, if any: it is settled too
    start: int  # tokens the target cache held before this call
    prompt_cache: Optional[list] = None  # the caller's list, when reused
    earlier: Optional[List[int]] = None  # the `start` tokens the cache held before, when known
    seen: Optional[List[int]] = None  # this call's prompt + tokens handed out, once it started
    # mlx-lm's kv_bits (cache/quantize.KVQuantizer): the target's layers quantized after the
    # forward that settling may run, as after any other
    quantizer: Optional[object] = None
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

    def hold(self, seen: List[int], upcoming: List[int] = ()) -> None:
        """Show `seen` (this call's tokens so far) while a response is out; `release()` takes it
        back. `upcoming`: the tokens the caller gets next, which a lazy view may cover at once.
        Only trims and lazy forwards that nothing computes unless the cache is read meanwhile."""
        wanted = self.start + len(seen)
        target = self.target
        if target.length < wanted:  # the call's last token (earlier ones wait for the next round)
            undos = [target.look_ahead(mx.array(seen[target.length - self.start:], mx.uint32))]
        else:
            undos = [target.peek(wanted)]
        if self.draft is not None:
            undos.append(self.draft.peek(seen, len(seen), upcoming))
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
        if self.quantizer is not None:  # (after the rounds' last forward, which the call's
            self.quantizer.settle()  # rounds may not have been resumed to follow)
        if target.length < wanted:  # lazily: computed by the cache's next use
            tail = seen[target.length - self.start:]
            # (kv_bits: no forward reaches past where the cache is quantized, as no round does)
            room = self.quantizer.room() if self.quantizer is not None else None
            for part in (tail[:room], tail[room:]) if room is not None else (tail,):
                if part:
                    target.forward(mx.array(part, mx.uint32))
                    if getattr(self.draft, "follows_target", False):  # a block drafter's taps
                        self.draft.follow(part, target.hidden)
                    if self.quantizer is not None:
                        self.quantizer.settle()
        if self.draft is not None:
            self.draft.settle(seen, len(seen))
        if self.prompt_cache:  # for the next call's prompt lookup (a proposal source only)
            known = self.earlier is not None and len(self.earlier) == self.start
            setattr(self.prompt_cache[0], TOKENS, self.earlier + list(seen) if known else None)
            # A block drafter's context of every token held, for the next call's drafter
            setattr(self.prompt_cache[0], CONTEXT, getattr(self.draft, "context", None))
            # mlx-lm's own classes again (RotatingKVCache for the sliding windows), lazily, so
            # that mlx-lm's save_prompt_cache / load_prompt_cache and generation take the list;
            # the next call makes them rewindable again. This call's layers are then no longer
            # the caller's: it gives the cache up (a generator resumed after this cannot go on).
            if make_plain(self.prompt_cache):
                setattr(self.prompt_cache[0], OWNER, None)
        self.seen = None  # settled: nothing for a later call to finish


def take_over(prompt_cache: Optional[list]) -> None:
    """Before a call reads a reused cache: its previous call, if still open and unsettled,
    leaves it holding what that call handed out."""
    owner = getattr(prompt_cache[0], OWNER, None) if isinstance(prompt_cache, list) and \
        prompt_cache else None
    earlier = owner() if isinstance(owner, weakref.ref) else None
    if earlier is not None:
        earlier.hand_over()


def held_context(prompt_cache: Optional[list]):
    """The block drafter's context the call that left a reused cache kept with it (None: none;
    the drafter checks it is its own and covers what the cache holds)."""
    return getattr(prompt_cache[0], CONTEXT, None) if isinstance(prompt_cache, list) and \
        prompt_cache else None


def held_tokens(prompt_cache: Optional[list], length: int) -> List[int]:
    """The first `length` tokens a reused cache holds, as the call that left it recorded
    them ([] when unknown: a new cache, or one fed by something else since)."""
    tokens = getattr(prompt_cache[0], TOKENS, None) if isinstance(prompt_cache, list) and \
        prompt_cache else None
    if not isinstance(tokens, list) or len(tokens) < length:
        return []
    return tokens[:length]  # (a trimmed cache keeps a prefix)
