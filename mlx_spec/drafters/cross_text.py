"""The same text in two vocabularies: the target's history as the draft's own ids, kept in
step as it grows, and the draft's text as target ids that continue the history.

Token boundaries do not line up across tokenizers, so the draft's ids are the draft
tokenizer's reading of the target's text, not a token-by-token translation. Where both
readings have a boundary at the same byte (a "mark"), the text before it is settled; each
time the history grows, the text from the last mark at least BACK_OFF target tokens before
the old end is read again (a word the target is still spelling may become one draft token),
and everything before it is kept. Text that ends inside a character (a byte-fallback piece,
a byte-level token holding half of one) waits: the draft is not shown half a character.
Special tokens are atomic: each maps by its string (`VocabBridge.special_for_draft`).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import List, Sequence, Tuple

from .vocab_bridge import VocabBridge, complete_length, encode_bytes, joined

BACK_OFF = 3  # target tokens read again before the old end whenever the history grows
ANCHOR = 3  # target tokens before the draft's text that its re-reading starts from


def _char_boundary(data: bytes, offset: int) -> bool:
    """Whether `offset` falls between two characters of `data` (not inside one)."""
    return offset >= len(data) or (data[offset] & 0xC0) != 0x80


class DraftText:
    """The draft's ids for the target's history: `update(history)` returns them for as much
    of the history as ends on a whole character (`covered` target tokens)."""

    def __init__(self, bridge: VocabBridge):
        self.bridge = bridge
        self.ids: List[int] = []
        self.covered = 0
        self._marks_t = [0]  # aligned boundaries: target index ...
        self._marks_d = [0]  # ... and the draft index at the same byte

    def update(self, history: Sequence[int]) -> List[int]:
        if len(history) == self.covered:
            return self.ids
        start = bisect_right(self._marks_t, max(0, self.covered - BACK_OFF)) - 1
        t0, d0 = self._marks_t[start], self._marks_d[start]
        ids, marks, end = self._read(history, t0, d0)
        self.ids = self.ids[:d0] + ids
        self._marks_t = self._marks_t[:start + 1] + [t for t, _ in marks]
        self._marks_d = self._marks_d[:start + 1] + [d for _, d in marks]
        self.covered = end
        return self.ids

    def lagging(self, history: Sequence[int]) -> bool:
        """Whether the history ends inside a character the draft has not been shown."""
        self.update(history)
        return self.covered < len(history)

    def _read(self, history: Sequence[int], t0: int, d0: int):
        """(draft ids for history[t0:end], marks (t, d) after t0, end)."""
        target = self.bridge.target
        ids: List[int] = []
        marks: List[Tuple[int, int]] = []
        text, bounds = bytearray(), []  # the current run of ordinary tokens; (offset, t) ends
        for t in range(t0, len(history)):
            token = history[t]
            if target.special[token]:
                self._run(bytes(text), bounds, ids, marks, d0, final=False)
                text, bounds = bytearray(), []
                ids += self.bridge.special_for_draft(token)
                marks.append((t + 1, d0 + len(ids)))
            else:
                text += target.pieces[token] or b""
                bounds.append((len(text), t + 1))
        end = self._run(bytes(text), bounds, ids, marks, d0, final=True)
        return ids, marks, end if end is not None else (marks[-1][0] if marks else t0)

    def _run(self, data: bytes, bounds, ids: List[int], marks, d0: int, final: bool):
        """Append the draft's ids for a run of ordinary text, and its marks; returns the target
        index it ends at (None when nothing of it could be read). The last run stops at the
        last target boundary on a whole character; an earlier one is read whole (a broken
        character before a special token is bytes)."""
        if not bounds:
            return None
        cut, end = len(data), bounds[-1][1]
        if final:
            whole = complete_length(data)
            usable = [(o, t) for o, t in bounds if o <= whole and _char_boundary(data, o)]
            if not usable:
                return None
            cut, end = usable[-1]
        part = data[:cut]
        new, exact = encode_bytes(self.bridge.draft, part)
        tail = part[complete_length(part):]  # a broken character before a special token
        new += [i for i in (self.bridge.draft.byte_ids[b] for b in tail) if i is not None]
        first = d0 + len(ids)
        ids += new
        if exact and not tail:
            ends, offset = {}, 0
            for j, token in enumerate(new):
                offset += len(self.bridge.draft.pieces[token] or b"")
                ends[offset] = first + j + 1
            marks += [(t, ends[o]) for o, t in bounds
                      if o <= cut and o in ends and _char_boundary(data, o)]
        else:  # the two texts differ here: settled only at the end of the run
            marks.append((end, d0 + len(ids)))
        return end


def target_continuation(bridge: VocabBridge, history: Sequence[int],
                        drafted: Sequence[int]) -> List[int]:
    """The target's ids for the text of the draft's tokens `drafted`, read as the target's
    tokenizer would continue the history: the history's last ANCHOR ordinary tokens and the
    draft's text are read together and the anchor's ids dropped when they come back unchanged
    (else the text is read alone). The text stops before a draft special token that has no
    target twin (after one that has), and before a character it holds only part of."""
    draft, target = bridge.draft, bridge.target
    text, tail = bytearray(), []
    for token in drafted:
        if draft.special[token]:
            twin = int(bridge.draft_to_target[token])
            tail = [twin] if twin >= 0 else []
            break
        text += draft.pieces[token] or b""
    data = bytes(text[:complete_length(bytes(text))])
    if not data:
        return tail
    anchor = []
    for token in reversed(history[-ANCHOR:]):
        if target.special[token]:
            break
        anchor.insert(0, token)
    before = joined(target, anchor)
    if anchor and _char_boundary(before, 0):
        ids, exact = encode_bytes(target, before + data)
        if exact and ids[:len(anchor)] == anchor:
            return ids[len(anchor):] + tail
    ids, _ = encode_bytes(target, data)
    return ids + tail
