"""Two vocabularies side by side: the bytes each token stands for, and the tokens both share.

A draft whose tokenizer differs from the target's speaks another vocabulary. What the two
have in common is text, so every token id is read as the bytes it adds to the text (a
byte-level BPE piece through GPT-2's byte alphabet, a SentencePiece piece with "▁" as a
space and <0xXX> as one byte); a special token (BOS, EOS, chat markers) stands for its own
string and is matched only with special tokens. Two tokens are twins when they stand for the
same bytes; `overlap` is the fraction of the target's tokens that have a twin.

`encode_bytes` turns bytes back into one vocabulary's ids whose bytes are exactly those
(never a SentencePiece space prefix in front, bytes that are not UTF-8 as single-byte tokens):
what keeps the two texts aligned byte for byte. Nothing here runs a model or touches MLX.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE_MARK = "\u2581"  # SentencePiece's "▁"


def _gpt2_bytes() -> Dict[str, int]:
    """GPT-2's printable character -> byte table (the inverse of bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in table.items()}


_GPT2_BYTES = _gpt2_bytes()


@dataclass
class Vocabulary:
    """One tokenizer's side: each id's bytes, its special tokens, and its encoder."""

    pieces: List[Optional[bytes]]  # id -> the bytes it adds to the text (None: nothing known)
    special: np.ndarray  # (V,) bool: control tokens, matched whole and only with each other
    encode: Callable[[str], List[int]]  # text -> ids, no BOS/EOS added
    bos_id: Optional[int] = None  # the BOS its encoder puts first (None: it adds none)
    eos_ids: Tuple[int, ...] = ()
    by_bytes: Dict[bytes, int] = field(default_factory=dict)  # normal tokens: bytes -> one id
    special_by_text: Dict[bytes, int] = field(default_factory=dict)
    byte_ids: List[Optional[int]] = field(default_factory=list)  # byte -> its single-byte token
    prefix: bytes = b""  # what its encoder puts in front of any text (a SentencePiece "▁")

    @property
    def size(self) -> int:
        return len(self.pieces)


def vocabulary(tokenizer) -> Vocabulary:
    """The `Vocabulary` of an mlx-lm `TokenizerWrapper` or a transformers tokenizer."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        pieces, special, fallback = _backend_pieces(backend)
        encode = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    else:  # a slow tokenizer: ask it one id at a time
        pieces, special, fallback = _decoded_pieces(hf)
        encode = lambda text: hf.encode(text, add_special_tokens=False)  # noqa: E731
    vocab = Vocabulary(pieces, special, encode)
    for index, (data, is_special) in enumerate(zip(pieces, special.tolist())):
        if data is None or not data:
            continue
        if is_special:
            vocab.special_by_text.setdefault(data, index)
        elif data not in vocab.by_bytes or (fallback[vocab.by_bytes[data]] and not fallback[index]):
            vocab.by_bytes[data] = index  # a normal piece before a <0xXX> one of the same byte
    vocab.byte_ids = [vocab.by_bytes.get(bytes([b])) for b in range(256)]
    vocab.prefix = _added_prefix(vocab)
    with_bos = hf.encode("a", add_special_tokens=True)
    bos = getattr(hf, "bos_token_id", None)
    vocab.bos_id = bos if bos is not None and with_bos and with_bos[0] == bos else None
    eos = getattr(tokenizer, "eos_token_ids", None) or \
        ([hf.eos_token_id] if getattr(hf, "eos_token_id", None) is not None else [])
    vocab.eos_ids = tuple(sorted(eos))
    return vocab


def _decoder_kind(backend) -> str:
    """"bytes" (GPT-2's byte alphabet), "pieces" (SentencePiece: ▁ and <0xXX>) or "other"."""
    decoder = backend.decoder
    if decoder is None:
        return "other"
    text = json.dumps(json.loads(decoder.__getstate__()))
    if '"ByteLevel"' in text:
        return "bytes"
    if '"Metaspace"' in text or SPACE_MARK in text or "\\u2581" in text:
        return "pieces"
    return "other"


def _backend_pieces(backend):
    """(bytes per id, special flags, <0xXX>-fallback flags) read from a `tokenizers` backend."""
    size = backend.get_vocab_size(with_added_tokens=True)
    vocab = backend.get_vocab(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    size = max(size, max(vocab.values(), default=-1) + 1)
    pieces: List[Optional[bytes]] = [None] * size
    special = np.zeros(size, bool)
    fallback = np.zeros(size, bool)
    kind = _decoder_kind(backend)
    for piece, index in vocab.items():
        token = added.get(index)
        if token is not None:
            pieces[index] = token.content.encode("utf-8")
            special[index] = token.special
        elif kind == "bytes":
            pieces[index] = _byte_level(piece)
        elif kind == "pieces":
            match = _BYTE_PIECE.fullmatch(piece)
            fallback[index] = match is not None
            pieces[index] = bytes([int(match.group(1), 16)]) if match else \
                piece.replace(SPACE_MARK, " ").encode("utf-8")
        else:
            pieces[index] = backend.decode([index], skip_special_tokens=False).encode("utf-8")
    return pieces, special, fallback


def _byte_level(piece: str) -> bytes:
    try:
        return bytes(_GPT2_BYTES[char] for char in piece)
    except KeyError:  # a piece outside the alphabet: its own characters
        return piece.encode("utf-8")


def _decoded_pieces(hf):
    size = len(hf)
    special_ids = set(getattr(hf, "all_special_ids", ()))
    pieces = [hf.decode([i]).encode("utf-8") for i in range(size)]
    special = np.array([i in special_ids for i in range(size)], bool)
    return pieces, special, np.zeros(size, bool)


def _added_prefix(vocab: Vocabulary) -> bytes:
    """What the encoder puts in front of any text: b" " for a SentencePiece with a space
    prefix (Llama 2), b"" for most."""
    ids = vocab.encode("a")
    data = b"".join(vocab.pieces[i] or b"" for i in ids)
    return data[:-1] if data.endswith(b"a") else b""


def joined(vocab: Vocabulary, ids: Sequence[int]) -> bytes:
    return b"".join(vocab.pieces[i] or b"" for i in ids)


def utf8_runs(data: bytes) -> Tuple[List[Union[str, int]], int]:
    """(runs, pending): the text of `data` as runs of valid UTF-8 (str) and single bytes that
    are not UTF-8 (int), and the length of an unfinished character at its end (not in runs)."""
    runs: List[Union[str, int]] = []
    start = 0
    while start < len(data):
        try:
            runs.append(data[start:].decode("utf-8"))
            return runs, 0
        except UnicodeDecodeError as error:
            bad = start + error.start
            if bad > start:
                runs.append(data[start:bad].decode("utf-8"))
            if error.reason == "unexpected end of data":
                return runs, len(data) - bad
            runs.append(data[bad])
            start = bad + 1
    return runs, 0


def complete_length(data: bytes) -> int:
    """How many leading bytes of `data` end on a whole character (or a byte that is not UTF-8)."""
    return len(data) - utf8_runs(data)[1]


def encode_bytes(vocab: Vocabulary, data: bytes) -> Tuple[List[int], bool]:
    """(ids, exact): `vocab`'s ids for `data` (whole characters), their bytes equal to it when
    `exact` (False when its tokenizer normalises text or lacks a character).

    Valid text goes through the encoder; a byte that is not UTF-8 becomes its single-byte
    token. An encoder that puts a space in front of any text (a SentencePiece prefix) gets
    the text without its leading space when it has one, else its first token loses the space.
    """
    runs, _ = utf8_runs(data)
    ids: List[int] = []
    for run in runs:
        if isinstance(run, int):
            if vocab.byte_ids[run] is not None:  # (else the byte is lost: not exact)
                ids.append(vocab.byte_ids[run])
        elif run:
            ids += _encode_text(vocab, run)
    return ids, joined(vocab, ids) == data


def _encode_text(vocab: Vocabulary, text: str) -> List[int]:
    prefix = vocab.prefix.decode("utf-8", "replace")
    if not prefix:
        return list(vocab.encode(text))
    if text.startswith(prefix):
        return list(vocab.encode(text[len(prefix):]))
    ids = list(vocab.encode(text))
    first = vocab.pieces[ids[0]] if ids else None
    if first is None or not first.startswith(vocab.prefix):
        return ids
    rest = first[len(vocab.prefix):]
    if not rest:
        return ids[1:]
    twin = vocab.by_bytes.get(rest)
    if twin is not None:
        return [twin] + ids[1:]
    singles = [vocab.byte_ids[b] for b in rest]
    return ids if None in singles else singles + ids[1:]


@dataclass
class VocabBridge:
    """The target's and the draft's vocabularies, and the twins between them."""

    target: Vocabulary
    draft: Vocabulary
    draft_to_target: np.ndarray  # (V_draft,) int64: the target twin of each draft id, -1 if none
    target_to_draft: np.ndarray  # (V_target,) int64: the draft twin of each target id, -1 if none

    @property
    def shared(self) -> int:
        """Target tokens that have a draft twin."""
        return int((self.target_to_draft >= 0).sum())

    @property
    def overlap(self) -> float:
        """The fraction of the target's tokens that have a draft twin."""
        return self.shared / max(self.target.size, 1)

    @property
    def draft_overlap(self) -> float:
        """The fraction of the draft's tokens that have a target twin."""
        return self.shared / max(self.draft.size, 1)

    def special_for_draft(self, target_id: int) -> List[int]:
        """What a target special token becomes in the draft's text: its twin by string; the
        draft's own BOS for the target's BOS (nothing when the draft adds none); the draft's
        EOS for an EOS; otherwise its string as text."""
        twin = int(self.target_to_draft[target_id])
        if twin >= 0:
            return [twin]
        if target_id == self.target.bos_id:
            return [] if self.draft.bos_id is None else [self.draft.bos_id]
        if target_id in self.target.eos_ids and self.draft.eos_ids:
            return [self.draft.eos_ids[0]]
        return encode_bytes(self.draft, self.target.pieces[target_id] or b"")[0]


def make_bridge(target_tokenizer, draft_tokenizer) -> VocabBridge:
    """The bridge between two tokenizers (reading a 262k vocabulary takes about a second)."""
    target, draft = vocabulary(target_tokenizer), vocabulary(draft_tokenizer)
    draft_to_target = np.full(draft.size, -1, np.int64)
    target_to_draft = np.full(target.size, -1, np.int64)
    for table_t, table_d in ((target.by_bytes, draft.by_bytes),
                             (target.special_by_text, draft.special_by_text)):
        for data, t in table_t.items():
            d = table_d.get(data)
            if d is not None:
                draft_to_target[d] = t
                target_to_draft[t] = d
    return VocabBridge(target, draft, draft_to_target, target_to_draft)


def vocabularies_differ(target_tokenizer, draft_tokenizer) -> bool:
    """Whether the draft's token ids mean other text than the target's: by the vocabularies'
    contents (each piece and its id, added tokens included), not by the tokenizers' names."""
    def pieces(tokenizer):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        return backend.get_vocab(with_added_tokens=True) if backend is not None else hf.get_vocab()

    return pieces(target_tokenizer) != pieces(draft_tokenizer)


# Below this fraction of the smaller vocabulary with a twin in the other, a draft of another
# tokenizer is not used (a warning says so): the two hardly write the same text.
MIN_SHARED_FRACTION = 0.1

_BRIDGES: dict = {}  # ids of the (target, draft) tokenizers inside any wrapper -> (them, bridge)


def bridge_for(target_tokenizer, draft_tokenizer) -> Optional[VocabBridge]:
    """The bridge between two tokenizers, None when their vocabularies are the same. The last
    two pairs' are kept (a 262k vocabulary takes about a second to read)."""
    key = tuple(id(getattr(t, "_tokenizer", t)) for t in (target_tokenizer, draft_tokenizer))
    if key not in _BRIDGES:
        bridge = make_bridge(target_tokenizer, draft_tokenizer) \
            if vocabularies_differ(target_tokenizer, draft_tokenizer) else None
        while len(_BRIDGES) >= 2:
            _BRIDGES.pop(next(iter(_BRIDGES)))
        _BRIDGES[key] = ((target_tokenizer, draft_tokenizer), bridge)  # held: the ids stay theirs
    return _BRIDGES[key][1]


def too_small(bridge: VocabBridge) -> bool:
    """Whether two vocabularies share too little for a draft to help (MIN_SHARED_FRACTION)."""
    return bridge.shared < MIN_SHARED_FRACTION * min(bridge.target.size, bridge.draft.size)
