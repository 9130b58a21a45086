"""Opening a GGUF file: its metadata as plain Python values and its tensor table.

The file is memory-mapped by the `gguf` package (llama.cpp's own reader);
nothing here converts weights. A path that is not a GGUF file, or one cut
short, is a ValueError with one sentence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path) -> bool:
    """True for a file (any name: an Ollama blob has no suffix) that starts with GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def find_gguf(path) -> Path | None:
    """The GGUF file a path names: the file itself, or the single *.gguf file in a directory.

    None when the path holds no GGUF file; a directory holding several is a
    ValueError (which one is meant cannot be guessed)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if is_gguf_file(path) else None
    if not path.is_dir():
        return None
    candidates = sorted(p for p in path.glob("*.gguf") if is_gguf_file(p))
    if (path / "config.json").exists() or not candidates:
        return None  # an MLX / Hugging Face directory is read the ordinary way
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise ValueError(f"The directory '{path}' holds several GGUF files ({names}); "
                         "pass the one to load.")
    return candidates[0]


def open_gguf(path):
    """A `gguf.GGUFReader` over the file, or one ValueError sentence if it cannot be read."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - gguf is a dependency
        raise ValueError("Reading GGUF files needs the 'gguf' package: pip install gguf.") from exc
    path = Path(path)
    if not is_gguf_file(path):
        raise ValueError(f"'{path}' is not a GGUF file (it does not start with the GGUF magic).")
    try:
        return GGUFReader(str(path), "r")
    except Exception as exc:  # truncated tables, a bad version, offsets past the end
        raise ValueError(f"Cannot read the GGUF file '{path}' (truncated or corrupt?): "
                         f"{type(exc).__name__}: {exc}") from None


def field_value(field):
    """One metadata field as Python: str, int, float or bool; a list of str for string arrays;
    a numpy array for numeric arrays."""
    from gguf import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        if len(field.types) > 1 and field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return np.zeros((0,), dtype=np.float32)
        parts = [field.parts[i] for i in field.data]
        return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0]).copy()
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_metadata(reader_or_path) -> dict:
    """Every key/value of the file's header (the GGUF.* bookkeeping keys left out)."""
    reader = open_gguf(reader_or_path) if isinstance(reader_or_path, (str, Path)) else reader_or_path
    return {key: field_value(field) for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}
