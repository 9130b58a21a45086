"""GGUF files for tests: tiny ones written with llama.cpp's `gguf` package, and the real ones.

`write_gguf(path, **fields)` writes a header with only the metadata given (no tensors);
`byte_level_tokens` and `sentencepiece_tokens` make tiny vocabularies of either kind;
`real_model_path(name)` finds a downloaded checkpoint, or None so a test can skip.
"""

from __future__ import annotations

import os
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

REAL_MODELS_DIR = Path("~/.cache/mlx-spec/real-models")


def real_model_path(name: str) -> Path | None:
    """`name` in $MLX_SPEC_REAL_MODELS or ~/.cache/mlx-spec/real-models, or None if absent."""
    root = Path(os.environ.get("MLX_SPEC_REAL_MODELS") or REAL_MODELS_DIR).expanduser()
    path = root / name
    return path if path.is_file() else None


def write_gguf(path, *, arch="llama", model=None, pre=None, tokens=None, token_types=None,
               scores=None, merges=None, bos=None, eos=None, unk=None, pad=None, add_bos=None,
               add_eos=None, add_space_prefix=None, chat_template=None) -> Path:
    """A GGUF file holding the tokenizer fields given (None leaves a field out) and no tensors."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    for value, add in ((model, writer.add_tokenizer_model), (pre, writer.add_tokenizer_pre),
                       (tokens, writer.add_token_list), (token_types, writer.add_token_types),
                       (scores, writer.add_token_scores), (merges, writer.add_token_merges),
                       (bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id),
                       (unk, writer.add_unk_token_id), (pad, writer.add_pad_token_id),
                       (add_bos, writer.add_add_bos_token), (add_eos, writer.add_add_eos_token),
                       (add_space_prefix, writer.add_add_space_prefix),
                       (chat_template, writer.add_chat_template)):
        if value is not None:
            add(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def gpt2_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def byte_level_tokens(merges, control=(), user_defined=()):
    """(tokens, token_types) of a byte-level BPE vocabulary: the control tokens, the user-defined
    ones, the 256 byte symbols, then one token per merge ("a b" makes "ab"), in that order."""
    tokens = [*control, *user_defined, *gpt2_alphabet().values()]
    tokens += ["".join(merge.split(" ")) for merge in merges]
    types = [CONTROL] * len(control) + [USER_DEFINED] * len(user_defined)
    return tokens, types + [NORMAL] * (len(tokens) - len(types))


def sentencepiece_tokens(pieces, control=("<s>", "</s>"), user_defined=()):
    """(tokens, token_types, scores) of a SentencePiece vocabulary: <unk>, the control tokens,
    the user-defined ones, the byte pieces <0x00>..<0xFF>, then `pieces` best-first (scores
    0, -1, -2, ...: a piece listed earlier wins a merge)."""
    head = ["<unk>", *control, *user_defined]
    types = [UNKNOWN] + [CONTROL] * len(control) + [USER_DEFINED] * len(user_defined)
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types += [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores
