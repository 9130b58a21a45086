"""A GGUF file's tokenizer, rebuilt from its metadata as an mlx-lm `TokenizerWrapper`.

A GGUF file has no tokenizer.json: llama.cpp stores the tokenizer as header arrays (the tokens,
each token's kind, SentencePiece scores or byte-level merges) plus special-token ids and flags.
This module rebuilds it with the `tokenizers` library (no torch, no transformers GGUF path) and
follows llama.cpp's `src/llama-vocab.cpp`, the program that wrote the file and runs it:

  "gpt2"   byte-level BPE: the text is split by the regexes `tokenizer.ggml.pre` names, each piece
           is spelled in GPT-2's byte alphabet, and the file's merges join it.
  "llama"  SentencePiece BPE: spaces become "▁" (one is prepended when `add_space_prefix`), pieces
           merge best-score first, and characters outside the vocabulary fall back to <0xXX> bytes.

Control tokens become special added tokens and user-defined ones plain added tokens; both are
matched whole in the raw text, as llama.cpp does. The streaming detokenizer is the one mlx-lm
would pick for the equivalent tokenizer.json (byte-level BPE or SentencePiece).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Chat models end a turn with their own token; generation stops there as well as at EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

# Pre-tokenizer regexes, as llama.cpp applies them: each splits the pieces the previous one made.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SINGLE_DIGITS = r"\p{N}"
# llama.cpp's fallback for a byte-level file whose pre-tokenizer it was not told.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text (llama.cpp's pre-tokenizer types)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token skips the merges
    add_bos: bool = False  # when the file has no tokenizer.ggml.add_bos_token


_GPT2 = PreTokenizer((GPT2_SPLIT,))
_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
PRE_TOKENIZERS = {
    "default": PreTokenizer(DEFAULT_SPLITS),
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "roberta-bpe"], _GPT2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"], PreTokenizer((SINGLE_DIGITS, GPT2_SPLIT))),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2"], _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe"], PreTokenizer((LLAMA3_SPLIT,))),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"],
                    PreTokenizer((QWEN2_SPLIT,))),
    "qwen35": PreTokenizer((QWEN35_SPLIT,)),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], PreTokenizer((GPT4O_SPLIT,))),
    "tekken": PreTokenizer((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
}


def load_tokenizer(metadata: dict, eos_token_ids=None):
    """The mlx-lm `TokenizerWrapper` for the tokenizer a GGUF file's metadata describes.

    `metadata` is `mlx_spec.gguf.reader.read_metadata(path)`. Generation stops at
    `eos_token_ids` (default: the file's EOS plus a chat vocabulary's end-of-turn token) and,
    as mlx-lm always adds it, at the tokenizer's EOS.
    """
    from mlx_lm.tokenizer_utils import (BPEStreamingDetokenizer, SPMStreamingDetokenizer,
                                        TokenizerWrapper)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("This GGUF file has no tokenizer in its metadata; load the tokenizer "
                         "from the original model's Hugging Face repository instead.")
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend, add_bos = byte_level_bpe(metadata)
        detokenizer_class = BPEStreamingDetokenizer
    elif kind == "llama":
        space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        backend, add_bos = sentencepiece_bpe(metadata, space_prefix), True
        detokenizer_class = partial(SPMStreamingDetokenizer, trim_space=space_prefix)
    else:
        raise ValueError(f"The GGUF file's tokenizer kind {kind!r} is not supported; mlx-spec "
                         "reads 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) only.")
    add_whole_tokens(backend, tokens, token_types(metadata))

    special = {f"{name}_token": token_at(metadata, f"tokenizer.ggml.{key}_token_id")
               for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"),
                                 ("pad", "padding"))}
    hf_tokenizer = adopt(
        backend,
        **{name: token for name, token in special.items() if token is not None},
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,  # decode as the streaming detokenizer does
    )
    if eos_token_ids is None:
        eos_token_ids = end_of_generation_ids(metadata)
    return TokenizerWrapper(hf_tokenizer, detokenizer_class, eos_token_ids=eos_token_ids)


def adopt(backend, **kwargs):
    """A transformers `PreTrainedTokenizerFast` around `backend` itself.

    `tokenizer_object=backend` would deep-copy it (two seconds for a 262k vocabulary); setting
    `_tokenizer` before `__init__` is how transformers' own tokenizer classes hand theirs over.
    With `add_bos_token`/`add_eos_token` given, transformers writes the BOS/EOS post-processor.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**kwargs)
    return tokenizer


def byte_level_bpe(metadata):
    """(a `tokenizers.Tokenizer` for a "gpt2" vocabulary, whether it adds BOS by default)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("The GGUF file's byte-level tokenizer has no merges "
                         "(tokenizer.ggml.merges); the file is incomplete.")
    name = metadata.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        warnings.warn(f"The GGUF file's pre-tokenizer {name!r} is unknown to mlx-spec; splitting "
                      "text with GPT-2's regex, so some token ids may differ from llama.cpp's.",
                      stacklevel=3)
        pre = _GPT2
    vocab = {token: index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    model = models.BPE(vocab, [tuple(merge.split(" ", 1)) for merge in merges],
                       ignore_merges=pre.ignore_merges)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, pre.add_bos


def sentencepiece_bpe(metadata, space_prefix: bool):
    """A `tokenizers.Tokenizer` for a "llama" (SentencePiece BPE) vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = metadata["tokenizer.ggml.tokens"]
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("The GGUF file's SentencePiece tokenizer has no score per token "
                         "(tokenizer.ggml.scores); the file is incomplete.")
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: index for index, token in enumerate(tokens)}
    model = models.BPE(vocab, merges_from_scores(tokens, scores, token_types(metadata)),
                       fuse_unk=True,
                       byte_fallback=True,
                       unk_token=tokens[unk_id] if unk_id is not None else None)
    backend = Tokenizer(model)
    spaces = normalizers.Replace(" ", "\u2581")
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), spaces])
                          if space_prefix else spaces)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        steps + [decoders.Strip(content=" ", left=1, right=0)] if space_prefix else steps)
    return backend


def merges_from_scores(tokens, scores, types):
    """BPE merges for a SentencePiece vocabulary: every split of a normal token into two normal
    tokens, best-scoring result first.

    SentencePiece (and llama.cpp) repeatedly joins the adjacent pair whose union scores highest;
    ranking merges by the score of what they make gives the same choice.
    """
    normal = {token for token, kind in zip(tokens, types.tolist()) if kind == NORMAL}
    merges = []
    for index in np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable").tolist():
        token = tokens[index]
        if len(token) < 2 or token not in normal:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                merges.append((left, right))
    return merges


def add_whole_tokens(backend, tokens, types):
    """Control and unknown tokens as special added tokens, user-defined ones as plain added
    tokens: matched whole in the raw text (never split into pieces), keeping their file ids."""
    from tokenizers import AddedToken

    kinds = types.tolist()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in zip(tokens, kinds)
                                if kind in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, kinds) if kind == USER_DEFINED])


def token_types(metadata) -> np.ndarray:
    """Each token's llama_token_type; a file without them has only normal tokens."""
    types = metadata.get("tokenizer.ggml.token_type")
    return np.asarray(types) if types is not None else np.full(
        len(metadata["tokenizer.ggml.tokens"]), NORMAL)


def token_at(metadata, key):
    """The text of the token whose id the metadata gives under `key`, or None."""
    tokens = metadata["tokenizer.ggml.tokens"]
    index = metadata.get(key)
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def end_of_generation_ids(metadata) -> list[int]:
    """The file's EOS id plus the end-of-turn token a chat vocabulary has."""
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    turn_ids = [index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])
                if token in END_OF_TURN_TOKENS]
    return ([eos_id] if eos_id is not None else []) + turn_ids
