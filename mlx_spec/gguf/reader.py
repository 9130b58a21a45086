"""Opening a GGUF file: its metadata as plain Python values and its tensor table.

GGUF (llama.cpp's format, versions 2 and 3): a header of typed key/value pairs,
a table of tensors (name, dimensions innermost first, type, offset), then the
tensor data, aligned. The file is memory-mapped; a tensor's bytes are read only
when converted. Parsed here rather than with `gguf.GGUFReader`, which takes
5-10 s over a 262,144-token vocabulary. A path that is not a GGUF file, or one
cut short, is a ValueError with one sentence.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> (struct format, numpy dtype)
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


def is_gguf_file(path) -> bool:
    """True for a file (any name: an Ollama blob has no suffix) that starts with GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def find_gguf(path) -> Path | None:
    """The GGUF file a path names: the file itself, or the single *.gguf file in a directory.

    None when the path holds no GGUF file (or is an MLX / Hugging Face directory with
    a config.json); a directory holding several is a ValueError (which one is meant
    cannot be guessed)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if is_gguf_file(path) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    candidates = sorted(p for p in path.glob("*.gguf") if is_gguf_file(p))
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise ValueError(f"The directory '{path}' holds several GGUF files ({names}); "
                         "pass the one to load.")
    return candidates[0] if candidates else None


@dataclass
class GgufTensor:
    """One entry of the tensor table; `data` is its raw bytes (a view into the mapped file)."""

    name: str
    shape: tuple  # GGUF order: innermost (contiguous) dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # uint8

    @property
    def kind(self) -> str:
        return self.tensor_type.name


@dataclass
class GgufFile:
    path: Path
    metadata: dict
    tensors: dict  # name -> GgufTensor, in file order


class _Cursor:
    def __init__(self, buffer, path):
        self.buffer, self.offset, self.path = buffer, 0, path

    def take(self, fmt):
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"The GGUF file '{self.path}' ends inside its header "
                             "(truncated?).") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self):
        length = self.take("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError(f"The GGUF file '{self.path}' ends inside its header (truncated?).")
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, kind):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.take("<I"), self.take("<Q")
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind not in _SCALARS:
                return [self.value(item_kind) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
            end = self.offset + count * dtype.itemsize
            if end > len(self.buffer):
                raise ValueError(f"The GGUF file '{self.path}' ends inside its header "
                                 "(truncated?).")
            array = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset).copy()
            self.offset = end
            return array
        if kind not in _SCALARS:
            raise ValueError(f"The GGUF file '{self.path}' has a value of unknown type {kind} "
                             "in its header (corrupt?).")
        value = self.take(_SCALARS[kind][0])
        return bool(value) if kind == 7 else value


def open_gguf(path) -> GgufFile:
    """Parse the header and tensor table of a GGUF file (the data stays mapped, unread)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not is_gguf_file(path):
        raise ValueError(f"'{path}' is not a GGUF file (it does not start with the GGUF magic).")
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    cursor.offset = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"'{path}' is GGUF version {version}; versions 2 and 3 are supported.")
    tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
        type_id, offset = cursor.take("<I"), cursor.take("<Q")
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"Tensor '{name}' in '{path}' has an unknown GGUF type "
                             f"({type_id}).") from None
        table.append((name, dims, kind, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        size = int(np.prod(dims, dtype=np.int64)) // block * block_bytes
        begin = start + offset
        if begin + size > len(mapped):
            raise ValueError(f"The GGUF file '{path}' is cut short: tensor '{name}' runs past "
                             "its end (an incomplete download?).")
        tensors[name] = GgufTensor(name, dims, kind, mapped[begin:begin + size])
    return GgufFile(path, metadata, tensors)


def read_metadata(path_or_file) -> dict:
    """Every key/value of the file's header: str, int, float or bool; a list of str for string
    arrays; a numpy array for numeric arrays."""
    gguf_file = path_or_file if isinstance(path_or_file, GgufFile) else open_gguf(path_or_file)
    return gguf_file.metadata
