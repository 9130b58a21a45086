"""The corpus, the tokenizer and the batches every stage trains on.

Data: Python source files of the running interpreter's standard library
(``sysconfig.get_paths()['stdlib']``), a fixed selection (``select_files``),
split by a SHA-1 hash of the *top-level module/package name* so that whole
modules are held out for validation (~5%); optionally the stdlib's own test
suite as extra training text. Tokenizer: byte-level BPE (Hugging Face
``tokenizers``), ``<|endoftext|>`` (id 0) is EOS/BOS and separates files.

Batches are pure functions of (data, step, seed): a resumed run draws the
same ones.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np


EOS = "<|endoftext|>"

EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages",
    "__pycache__", "lib2to3", "ensurepip", "venv", "pydoc_data",
}
MAX_FILE_BYTES = 100_000
SAMPLE_HEADERS = ("def fibonacci(n):", "def is_prime(n):", "def read_lines(path):",
                  "def add(a, b):", "def flatten(items):", "class Stack:")
VAL_PERCENT = 5


def select_files(root: Path) -> list[Path]:
    """Sorted *.py files under stdlib root, minus tests/idle/demo/site-packages,
    files named test_*.py and files larger than MAX_FILE_BYTES."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        parts = rel.parts
        if any(d in EXCLUDED_DIRS or d.startswith("test") for d in parts[:-1]):
            continue
        if parts[-1].startswith("test_") or parts[-1] == "__phello__.py":
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    return out


def module_key(rel: Path) -> str:
    """Top-level module or package name: whole packages go to the same split."""
    first = rel.parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_val(rel: Path) -> bool:
    h = int(hashlib.sha1(module_key(rel).encode()).hexdigest()[:8], 16)
    return h % 100 < VAL_PERCENT


def select_test_files(root: Path, val_modules: list[str]) -> list[Path]:
    """Sorted *.py files of the stdlib's own test suite (``test/``), at most
    MAX_FILE_BYTES each, minus tests of held-out modules (``test_<val module>*``
    files and directories), so no validation module leaks into training."""
    out = []
    for p in sorted((root / "test").rglob("*.py")):
        rel = p.relative_to(root / "test")
        if "__pycache__" in rel.parts or p.stat().st_size > MAX_FILE_BYTES:
            continue
        names = [n[:-3] if n.endswith(".py") else n for n in rel.parts]
        if any(n.startswith("test_") and n[5:].startswith(m) for n in names for m in val_modules):
            continue
        out.append(p)
    return out


def load_test_corpus(root: Path, val_modules: list[str]):
    docs = []
    for p in select_test_files(root, val_modules):
        try:
            docs.append((str(p.relative_to(root)), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def load_corpus():
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for p in select_files(root):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = p.relative_to(root)
        (val if is_val(rel) else train).append((str(rel), text))
    return root, train, val


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts, eos_id):
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


@dataclass
class KDMix:
    """Batches whose rows are ``kd_fraction`` target-generated text, the rest ``real`` data."""

    real: object
    generated: np.ndarray
    kd_fraction: float


def get_batch(data, step, seed, batch, seq):
    """``data`` is a token array, or a (core, extended, from_step) triple: batches of
    steps >= from_step are drawn from the extended array (curriculum, see --tests-from-step)."""
    import torch

    if isinstance(data, KDMix):
        n_kd = round(batch * data.kd_fraction)
        x2, y2 = get_batch(data.generated, step, seed + 1, n_kd, seq)
        if n_kd == batch:
            return x2, y2
        x1, y1 = get_batch(data.real, step, seed, batch - n_kd, seq)
        return torch.cat([x1, x2]), torch.cat([y1, y2])
    if isinstance(data, tuple):
        core, extended, from_step = data
        data = extended if step >= from_step else core

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    x = torch.stack([torch.from_numpy(data[i : i + seq + 1].astype(np.int64)) for i in ix.tolist()])
    return x[:, :-1], x[:, 1:]


def make_prompts(data, n, plen, seed, eos_id, gen):
    """n deterministic prompts of plen tokens from ``data`` that do not straddle a file boundary."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        i = int(rng.integers(0, len(data) - plen - gen - 1))
        w = data[i : i + plen + gen]
        if (w == eos_id).any():
            continue
        out.append(data[i : i + plen].astype(np.int64))
    return out


def write_tokenizer_files(tok, tok_dir: Path):
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }, indent=2) + "\n")
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": EOS, "eos_token": EOS}, indent=2) + "\n")
