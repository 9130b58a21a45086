"""Token sequences seen before (prompts and outputs, this request's and earlier ones) and
what followed each suffix of a context in them: the data behind suffix drafting.

A `SuffixIndex` holds sequences up to a token budget (least recently used
evicted first; a sequence still being generated is never evicted) and answers,
for a context (the current request's tokens):

- `longest(context)`: m, the length of the longest suffix of the context (at
  most MAX_MATCH tokens) that occurs in a held sequence with at least one token
  after it, and every such occurrence (the index just past it in its sequence);
- `follow(match, context, k)`: the most frequent continuation of those
  occurrences, one token at a time: the token most of the still-agreeing
  occurrences continue with (a tie goes to the latest occurrence), kept while
  at least `min_share` of the matched occurrences agree with the whole path.
  An occurrence in the context itself that runs into its end continues with the
  proposal (a loop in the output repeats with its period, as prompt lookup's).
- `follow_paths(match, context, k, width)`: up to `width` distinct continuations
  for a token tree (drafters/tree.py): `follow`'s first; then, where some of
  the occurrences (at least `min_share` of the matched ones) left a path with
  another token, that group followed on by the same rule, the largest group
  first (a tie: the latest occurrence). `follow` is its first path.

How it is fast: every token is filed under the n-grams ending at it of two
lengths, 1 and ANCHOR (4): a match of ANCHOR tokens or more is among the latest
occurrences of the context's last 4 tokens, a shorter one among the latest of
its last token; the exact length of each candidate is measured by comparing
slices backwards. Only the latest occurrences of an n-gram are candidates (64
of a 4-gram, 16 of a single token; older ones drop out, as in zlib's hash
chains). Lookups take tens
of microseconds; filing costs two dictionary updates per token
(tests/test_suffix.py checks all of it against a brute-force search).

A sequence added `live` is the caller's own list (a request's history, growing
as tokens are emitted): the index reads its new tokens at the next lookup, so
the request's output is in the index without a copy and without a hook at its
end. `release` lets it be evicted again.

Files: `save_indexes` / `load_indexes` write and read named indexes (the
server's partitions) as one .npz file with a format version; anything else is
refused with one sentence.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

ANCHOR = 4  # the long n-gram length: matches of at least this many tokens are found through it
MAX_MATCH = 64  # a longer common suffix counts as this long
MAX_OCCURRENCES = 64  # the latest occurrences of an ANCHOR-gram that are candidates
SHORT_OCCURRENCES = 16  # the latest occurrences of the last token that are (for shorter matches)
DEFAULT_SUFFIX_TOKENS = 1 << 20  # the token budget of an index (about 1M tokens)
DEFAULT_MIN_SHARE = 0.1  # a proposed token is one at least this share of the matches continue with
FORMAT = "mlx-spec suffix index"
FORMAT_VERSION = 1
_SHIFT = 32  # a position is packed as sequence id << 32 | index
_MASK = (1 << _SHIFT) - 1


@dataclass
class Match:
    """The longest suffix of a context found in the index, and where it occurs."""

    length: int  # m: 0 when not even the last token occurred before
    positions: List[int]  # packed (sequence, index just past the occurrence), oldest first


class _Sequence:
    __slots__ = ("tokens", "filed", "pinned")

    def __init__(self, tokens: List[int], pinned: bool):
        self.tokens = tokens
        self.filed = 0  # n-grams ending before this index are filed
        self.pinned = pinned


def _common_suffix(a: Sequence[int], end_a: int, b: Sequence[int], end_b: int, limit: int) -> int:
    """How many tokens before a[end_a] and b[end_b] agree (at most `limit`): slices compared
    in growing, then shrinking steps (each comparison runs in C)."""
    same, step = 0, 4
    while same < limit:
        s = step if step < limit - same else limit - same
        if a[end_a - same - s:end_a - same] == b[end_b - same - s:end_b - same]:
            same += s
            step += step
        elif s == 1:
            break
        else:
            step = s >> 1
    return same


class SuffixIndex:
    """Sequences of token ids and where their short n-grams occur (see the module docstring).

    `max_tokens` bounds the tokens held; `vocab_size` is set by the first model that drafts
    from it (a file records it), so an index is never used with another vocabulary.
    Thread-safe: the server's worker and its HTTP side may touch it at once.
    """

    def __init__(self, max_tokens: int = DEFAULT_SUFFIX_TOKENS, vocab_size: Optional[int] = None):
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens of a suffix index must be an int >= 1, got {max_tokens!r}.")
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._sequences: "OrderedDict[int, _Sequence]" = OrderedDict()  # least recently used first
        self._next_id = 0
        self._short: Dict[int, List[int]] = {}  # token -> positions just past it
        self._long: Dict[int, List[int]] = {}  # hash of an ANCHOR-gram -> positions just past it
        self._live: Dict[int, _Sequence] = {}  # sequences whose list may still grow
        self._held = 0  # tokens filed, over all sequences
        self._lock = threading.RLock()

    # --- what it holds ---
    def __len__(self) -> int:
        """Tokens held."""
        with self._lock:
            self._catch_up()
            return self._held

    def __bool__(self) -> bool:
        return True  # an empty index is still one to draft from: `suffix=index` is never "off"

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def sequences(self) -> List[List[int]]:
        """The held sequences, least recently used first (copies)."""
        with self._lock:
            return [list(s.tokens) for s in self._sequences.values()]

    def add(self, tokens: List[int], live: bool = False) -> int:
        """Hold `tokens` (a copy; with `live`, the caller's list itself, read again at every
        lookup and kept until `release`). Returns its id."""
        with self._lock:
            seq_id = self._next_id
            self._next_id += 1
            sequence = _Sequence(tokens if live else list(tokens), pinned=live)
            self._sequences[seq_id] = sequence
            if live:
                self._live[seq_id] = sequence
            self._file(seq_id, sequence)
            self._evict()
            return seq_id

    def release(self, seq_id: int) -> None:
        """A live sequence stops growing: file its last tokens; it may be evicted from now on."""
        with self._lock:
            sequence = self._live.pop(seq_id, None)
            if sequence is None:
                return
            self._file(seq_id, sequence)
            sequence.tokens = list(sequence.tokens)  # the caller's list is theirs again
            sequence.pinned = False
            self._evict()

    def save(self, path) -> None:
        """Write the index to `path` (.npz; `SuffixIndex.load` reads it back)."""
        save_indexes(path, {"": self})

    @classmethod
    def load(cls, path) -> "SuffixIndex":
        """The index saved at `path`, or ValueError (one sentence)."""
        indexes = load_indexes(path)
        if list(indexes) != [""]:
            raise ValueError(f"{path} holds the server's partitioned suffix indexes; load it "
                             f"with mlx_spec.drafters.suffix_index.load_indexes.")
        return indexes[""]

    # --- lookups ---
    def longest(self, context: Sequence[int]) -> Match:
        """The longest suffix of `context` held with a token after it, and its occurrences."""
        with self._lock:
            self._catch_up()
            if not context:
                return Match(0, [])
            if len(context) >= ANCHOR:
                found = self._measure(self._long.get(hash(tuple(context[-ANCHOR:]))), context,
                                      MAX_OCCURRENCES, MAX_MATCH)
                if found.length >= ANCHOR:
                    return found
            # Shorter than ANCHOR: the latest few occurrences of the last token are enough
            found = self._measure(self._short.get(context[-1]), context, SHORT_OCCURRENCES,
                                  ANCHOR - 1)
            return found if found.length else Match(0, [])

    def follow(self, match: Match, context: Sequence[int], k: int,
               min_share: float = DEFAULT_MIN_SHARE) -> List[int]:
        """Up to k tokens: the most frequent continuation of `match` (see the module docstring)."""
        paths = self.follow_paths(match, context, k, 1, min_share)
        return paths[0] if paths else []

    def follow_paths(self, match: Match, context: Sequence[int], k: int, width: int,
                     min_share: float = DEFAULT_MIN_SHARE) -> List[List[int]]:
        """Up to `width` distinct continuations of `match`, each up to k tokens: the most
        frequent first (`follow`'s), then, most occurrences first (a tie: the latest), each
        group of occurrences that left a path where they disagreed with it, followed from
        there by the same rule (see the module docstring). No path is a prefix of another."""
        with self._lock:
            alive = [(self._tokens_of(p), p & _MASK, rank)  # rank: later is more recent
                     for rank, p in enumerate(match.positions)]
            alive = [(tokens, end, rank) for tokens, end, rank in alive if tokens is not None]
            needed = min_share * len(alive)
            branches: list = []  # (occurrences, latest, path so far, its occurrences)
            paths: List[List[int]] = []
            path = self._follow_from(alive, [], context, k, needed, branches if width > 1 else None)
            while path:
                paths.append(path)
                if len(paths) == width or not branches:
                    break
                best = max(range(len(branches)), key=lambda b: branches[b][:2])
                _, _, prefix, group = branches.pop(best)
                path = self._follow_from(group, prefix, context, k, needed, branches)
            self._touch(match.positions)
            return paths

    # --- inside ---
    def _follow_from(self, alive, prefix: List[int], context, k: int, needed: float,
                     branches: Optional[list]) -> List[int]:
        """`prefix` extended up to k tokens by the most frequent next token of the occurrences
        still `alive` ((tokens, end, rank): each agrees with the prefix), while at least
        `needed` agree; each other token at least `needed` continue with is added to
        `branches` (None: not wanted)."""
        proposal = list(prefix)
        for j in range(len(proposal), k):
            if len(alive) == 1 and needed <= 1:  # one occurrence left: copy what follows it
                tokens, end, _ = alive[0]
                proposal.extend(tokens[end + j:end + k])
                while len(proposal) < k:
                    token = self._token_at(tokens, end + len(proposal), context, proposal)
                    if token is None:
                        break
                    proposal.append(token)
                break
            counts: Dict[int, int] = {}
            latest: Dict[int, int] = {}
            nexts = []
            for tokens, end, rank in alive:
                token = self._token_at(tokens, end + j, context, proposal)
                nexts.append(token)
                if token is not None:
                    counts[token] = counts.get(token, 0) + 1
                    latest[token] = rank
            if not counts:
                break
            token = max(counts, key=lambda t: (counts[t], latest[t]))
            if counts[token] < needed:
                break
            if branches is not None:
                for other, count in counts.items():
                    if other != token and count >= needed:
                        branches.append((count, latest[other], proposal + [other],
                                         [a for a, t in zip(alive, nexts) if t == other]))
            proposal.append(token)
            alive = [a for a, t in zip(alive, nexts) if t == token]
        return proposal

    @staticmethod
    def _token_at(tokens, i: int, context, proposal: List[int]) -> Optional[int]:
        if i < len(tokens):
            return tokens[i]
        if tokens is context and i - len(tokens) < len(proposal):  # the context continues
            return proposal[i - len(tokens)]  # with what is being proposed
        return None

    def _tokens_of(self, position: int):
        sequence = self._sequences.get(position >> _SHIFT)
        return None if sequence is None else sequence.tokens

    def _measure(self, positions: Optional[List[int]], context: Sequence[int], latest: int,
                 longest: int) -> Match:
        """The latest candidates' longest common suffix with the context (at most `longest`),
        and those that reach it."""
        best, found = 0, []
        n = len(context)
        sequences = self._sequences
        for p in (positions or ())[-latest:]:
            sequence = sequences.get(p >> _SHIFT)
            end = p & _MASK
            if sequence is None or end >= len(sequence.tokens):  # evicted, or a live list that
                continue  # lost its last token
            same = _common_suffix(sequence.tokens, end, context, n, min(end, n, longest))
            if same > best:
                best, found = same, [p]
            elif same == best and same:
                found.append(p)
        return Match(best, found)

    def _touch(self, positions: List[int]) -> None:
        for seq_id in {p >> _SHIFT for p in positions}:
            if seq_id in self._sequences:
                self._sequences.move_to_end(seq_id)

    def _catch_up(self) -> None:
        if not self._live:
            return
        for seq_id, sequence in self._live.items():
            self._file(seq_id, sequence)
        self._evict()

    def _file(self, seq_id: int, sequence: _Sequence) -> None:
        """File the n-grams that now have a token after them (ending before the last token)."""
        tokens = sequence.tokens
        self._held += len(tokens) - sequence.filed  # a live list may have lost its last token
        base = seq_id << _SHIFT
        for end in range(max(sequence.filed, 1), len(tokens)):
            _append(self._short, tokens[end - 1], base | end)
            if end >= ANCHOR:
                _append(self._long, hash(tuple(tokens[end - ANCHOR:end])), base | end)
        sequence.filed = len(tokens)

    def _evict(self) -> None:
        if self._held <= self.max_tokens:
            return
        for seq_id in list(self._sequences):
            sequence = self._sequences[seq_id]
            if not sequence.pinned:
                self._forget(seq_id, sequence)
                if self._held <= self.max_tokens:
                    return

    def _forget(self, seq_id: int, sequence: _Sequence) -> None:
        del self._sequences[seq_id]
        self._held -= sequence.filed
        tokens = sequence.tokens[:sequence.filed]
        # Every n-gram of the sequence, its last one included: a live list that lost its
        # last token (a generation ending on a full round) filed one more position.
        keys_short = set(tokens)
        keys_long = {hash(tuple(tokens[e - ANCHOR:e])) for e in range(ANCHOR, len(tokens) + 1)}
        for table, keys in ((self._short, keys_short), (self._long, keys_long)):
            for key in keys:
                positions = table.get(key)
                if positions is None:
                    continue
                positions[:] = [p for p in positions if p >> _SHIFT != seq_id]
                if not positions:
                    del table[key]


def _append(table: Dict[int, List[int]], key: int, position: int) -> None:
    positions = table.get(key)
    if positions is None:
        table[key] = [position]
        return
    positions.append(position)
    if len(positions) > 2 * MAX_OCCURRENCES:  # only the latest are candidates
        del positions[:-MAX_OCCURRENCES]


# --- files ---

def save_indexes(path, indexes: Mapping[str, SuffixIndex]) -> None:
    """Write named indexes to `path` (.npz), atomically: a crash leaves the old file."""
    names, counts, lengths, chunks, budgets, vocabs = [], [], [], [], [], []
    for name, index in indexes.items():
        sequences = index.sequences()
        names.append(name)
        counts.append(len(sequences))
        budgets.append(index.max_tokens)
        vocabs.append(-1 if index.vocab_size is None else index.vocab_size)
        lengths.extend(len(s) for s in sequences)
        chunks.extend(sequences)
    tokens = np.fromiter((t for s in chunks for t in s), dtype=np.int64)
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, format=np.array(FORMAT), version=np.array(FORMAT_VERSION),
                 names=np.array(names, dtype=str), counts=np.array(counts, np.int64),
                 budgets=np.array(budgets, np.int64), vocabs=np.array(vocabs, np.int64),
                 lengths=np.array(lengths, np.int64), tokens=tokens)
    os.replace(tmp, path)


class _Refused(Exception):
    """Why a readable .npz file is not one to load."""


def load_indexes(path) -> Dict[str, SuffixIndex]:
    """The named indexes in `path`, or ValueError (one sentence) when it is not such a file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"No suffix index file at {path}.")
    try:
        with np.load(path, allow_pickle=False) as data:
            if "format" not in data.files or str(data["format"]) != FORMAT:
                raise _Refused("not written by mlx-spec")
            version = int(data["version"])
            if version != FORMAT_VERSION:
                raise _Refused(f"format version {version}; this mlx-spec reads {FORMAT_VERSION}")
            names = [str(n) for n in data["names"]]
            counts, budgets, vocabs = (data[k].tolist() for k in ("counts", "budgets", "vocabs"))
            lengths, tokens = data["lengths"].tolist(), data["tokens"]
    except _Refused as exc:
        raise ValueError(f"{path} is not a suffix index this mlx-spec can read ({exc}); "
                         f"delete it or give another file.") from None
    except Exception:  # not a zip, truncated, pickled objects, missing keys, wrong dtypes
        raise ValueError(f"{path} is not a suffix index this mlx-spec can read (not an .npz "
                         f"file it wrote, or damaged); delete it or give another file.") from None
    if not (len(names) == len(counts) == len(budgets) == len(vocabs)) or \
            sum(counts) != len(lengths) or sum(lengths) != tokens.shape[0] or \
            (tokens.size and tokens.min() < 0) or any(b < 1 for b in budgets) or \
            (tokens.size and any(0 <= v <= tokens.max() for v in vocabs)):
        raise ValueError(f"{path} is a damaged suffix index (its parts do not add up); delete it "
                         f"or give another file.")
    indexes, start, seq = {}, 0, 0
    flat = tokens.tolist()
    for name, count, budget, vocab in zip(names, counts, budgets, vocabs):
        index = SuffixIndex(budget, None if vocab < 0 else vocab)
        for length in lengths[seq:seq + count]:
            index.add(flat[start:start + length])
            start += length
        seq += count
        indexes[name] = index
    return indexes
