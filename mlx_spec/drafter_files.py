"""A published drafter's files: where they are, its config.json, its weights checked against
the module built from that config (DFlash drafters and EAGLE-3 heads read theirs here).

Where: a local directory, or a Hugging Face repo id already in the local cache (nothing is
downloaded here). Every problem is one sentence that starts with `where` (e.g. "The DFlash
drafter in DIR"): no readable or no JSON config.json, no or unreadable *.safetensors, missing
or unexpected weights, a weight of the wrong shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

PREFIX = "model."  # accepted in front of every weight name


def local_directory(path: str) -> Optional[Path]:
    """`path` if it exists, else the local cache's copy of the repo id `path`, else None."""
    if Path(path).exists():
        return Path(path)
    parts = path.split("/")
    if len(parts) != 2 or not all(parts) or path.startswith((".", "~")):
        return None
    from mlx_lm.utils import hf_repo_to_path

    try:
        return hf_repo_to_path(path)  # the local cache only: nothing is downloaded here
    except Exception:
        return None


def located(path, what: str,
            local: Callable[[str], Optional[Path]] = local_directory) -> Tuple[Path, str]:
    """(the local directory of the `what` (e.g. "DFlash drafter") at `path`, the words that
    start every sentence about it: "The {what} in DIR")."""
    directory = local(str(path))
    if directory is None:
        raise ValueError(f"{what} '{path}' was not found: give a local directory or the repo id "
                         "of one in the Hugging Face cache.")
    return directory, f"The {what} in {directory}"


def directory_of(directory: Optional[Path], is_config: Callable[[dict], bool]) -> Optional[Path]:
    """`directory` when its config.json is one `is_config` recognises, else None."""
    if directory is None or not (directory / "config.json").exists():
        return None
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return directory if is_config(config) else None


def read_config(directory: Path, where: str) -> dict:
    """The parsed config.json of `directory`."""
    try:
        return json.loads((directory / "config.json").read_text())
    except OSError as exc:
        raise ValueError(f"{where} has no readable config.json ({exc.strerror}).") from None
    except ValueError:
        raise ValueError(f"{where} has a config.json that is not JSON.") from None


def read_weights(directory: Path, where: str,
                 rename: Callable[[str], Optional[str]] = lambda name: name) -> dict:
    """{name: array} from every *.safetensors file, `PREFIX` dropped, then `rename`d (None:
    the weight is left out)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{where} has no *.safetensors weights.")
    weights = {}
    for file in files:
        try:
            tensors = mx.load(str(file))
        except Exception as exc:  # noqa: BLE001 (a damaged file is the user's to replace)
            raise ValueError(f"{where}: {file.name} cannot be read ({exc}).") from None
        for name, value in tensors.items():
            if name.startswith(PREFIX):
                name = name[len(PREFIX):]
            name = rename(name)
            if name is not None:
                weights[name] = value
    return weights


def load_checked(module: nn.Module, weights: dict, where: str, layout: str) -> None:
    """Load `weights` into `module` if they are exactly its parameters, each of its shape."""
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"holds an unexpected weight {unexpected[0]}"
        raise ValueError(f"{where} {what}; it is not in the {layout} layout its config "
                         f"describes ({len(missing)} missing, {len(unexpected)} unexpected).")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise ValueError(f"{where}: weight {name} has shape {tuple(value.shape)}, the config "
                             f"says {tuple(expected[name].shape)}.")
    module.load_weights(list(weights.items()))
