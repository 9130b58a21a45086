"""Loading a target sharded across the ranks of a launch, and the draft whole on every rank.

`load_sharded(target, draft)` runs on every rank of an `mlx.launch`:

1. every rank fingerprints the model directories it was given (config and
   index files, weight file names and sizes) and the ranks compare them in one
   all-gather: ranks that would load different models stop, all of them, with
   one sentence;
2. the target's mlx-lm class must support tensor parallelism (`shard()`) or
   pipelining (`model.pipeline()`), and its heads or layers must divide among
   the ranks;
3. mlx-lm's `sharded_load` loads each rank's share (tensor parallel when the
   class has `shard()`, else pipeline; `sharding=` chooses);
4. the draft is loaded whole on every rank (so drafting needs no network) and
   must be smaller than each rank's share of the target. An MTP layer
   (`draft_model="mtp"`) is read later, whole on every rank, from the
   target's directory (noted on the model, as `mlx_spec.load` does) or
   `mtp_weights`.

Every error a user can cause is a ValueError with one sentence, raised on
every rank alike, so no rank waits for another that gave up.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..loading import _looks_like_repo_id, _remember_directory, check_pair
from ..loading import load as load_whole
from .group import launched_group, mark_sharded

SHARDINGS = ("auto", "tensor", "pipeline")


def load_sharded(target_path: str, draft_path: Optional[str] = None, group=None,
                 sharding: str = "auto") -> Tuple[object, object, Optional[object]]:
    """(target sharded over `group`, tokenizer, draft or None) on this rank.

    `group` defaults to the launch's group (`mlx.launch`); `sharding` is
    "auto" (tensor parallel when the class supports it, else pipeline),
    "tensor" or "pipeline".
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}.")
    group = group if group is not None else launched_group()
    if group is None or group.size() < 2:
        raise ValueError("load_sharded needs a group of two or more ranks; start the program "
                         "with mlx.launch --hosts A,B (or -n 2 on one machine).")
    target_dir, target_error = _local_dir(target_path)
    draft_dir, draft_error = _local_dir(draft_path) if draft_path is not None else (None, None)
    _check_same_models(group, target_dir, draft_dir)
    if target_error or draft_error:
        raise ValueError(target_error or draft_error)
    sharding = _check_shardable(target_dir, group, sharding)
    target, tokenizer = _sharded_load(target_dir, group, sharding)
    mark_sharded(target, group)
    _remember_directory(target, str(target_dir))  # its MTP weights (draft_model="mtp") are there
    if draft_path is None:
        return target, tokenizer, None
    draft, draft_tokenizer = load_whole(str(draft_dir))
    check_pair(target, draft, tokenizer, draft_tokenizer)
    check_draft_fits(target, draft)
    return target, tokenizer, draft


def parameter_bytes(model) -> int:
    return sum(w.nbytes for _, w in tree_flatten(model.parameters()))


def check_draft_fits(target, draft) -> None:
    """Refuse a draft larger than one rank's share of the target.

    Each rank holds a whole copy of the draft; a draft step would then cost
    more than this rank's part of a verify pass, and speculation cannot win.
    """
    target_share, draft_size = parameter_bytes(target), parameter_bytes(draft)
    if draft_size > target_share:
        raise ValueError(
            f"The draft model ({draft_size / 1e6:.1f} MB) is larger than each rank's share of the "
            f"sharded target ({target_share / 1e6:.1f} MB); every rank keeps a whole copy of the "
            "draft, so choose a smaller draft (or run without one).")


def _local_dir(path) -> Tuple[Optional[Path], Optional[str]]:
    """(the model's local directory, None) or (None, why it cannot be read)."""
    path = str(path)
    if Path(path).is_dir():
        return Path(path), None
    if not _looks_like_repo_id(path):
        return None, (f"Model path '{path}' does not exist on this machine; put the same model "
                      "at the same path on every machine of the launch.")
    from mlx_lm.utils import _download

    try:
        return Path(_download(path)), None
    except Exception as exc:  # hub errors, offline, missing files
        return None, f"Could not fetch model '{path}': {type(exc).__name__}: {exc}".strip()


def fingerprint(directory: Optional[Path]) -> int:
    """A 62-bit digest of a model directory's JSON files and weight file names and sizes."""
    if directory is None:
        return 0
    digest = hashlib.sha256()
    for file in sorted(directory.iterdir()):
        if file.suffix == ".json" and file.name != "model.safetensors.index.json":  # derived
            digest.update(file.name.encode() + file.read_bytes())
        elif file.suffix == ".safetensors":
            digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 2


def _check_same_models(group, target_dir, draft_dir) -> None:
    """One all-gather: every rank must have read the same target and draft as rank 0."""
    mine = []
    for directory in (target_dir, draft_dir):
        value = fingerprint(directory)
        mine += [value >> 31, value & (2**31 - 1)]
    everyone = mx.distributed.all_gather(mx.array(mine, mx.int32), group=group)
    message = disagreement(everyone.reshape(group.size(), 4).tolist())
    if message:
        raise ValueError(message)


def disagreement(rows) -> Optional[str]:
    """The sentence for the first rank whose (target, draft) fingerprints differ from rank 0's."""
    for rank, row in enumerate(rows[1:], start=1):
        for role, columns in (("target", slice(0, 2)), ("draft", slice(2, 4))):
            if row[columns] != rows[0][columns]:
                return (f"Rank {rank} has a different {role} model than rank 0 (its config or "
                        "weight files differ, or it is missing); put the same model at the same "
                        "path on every machine.")
    return None


def _check_shardable(directory: Path, group, sharding: str) -> str:
    """The sharding to use ("tensor" or "pipeline"); ValueError when the class allows none."""
    from mlx_lm.utils import load_model

    model, config = load_model(directory, lazy=True, strict=False)
    tensor = hasattr(model, "shard")
    pipeline = hasattr(getattr(model, "model", None), "pipeline")
    name = config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])
    if sharding == "auto":
        sharding = "tensor" if tensor else "pipeline" if pipeline else "none"
    if sharding == "none" or (sharding == "tensor" and not tensor) or \
            (sharding == "pipeline" and not pipeline):
        can = [s for s, ok in (("tensor", tensor), ("pipeline", pipeline)) if ok]
        raise ValueError(
            f"mlx-lm's {name} model class cannot be sharded "
            f"{'that way (it supports ' + ' and '.join(can) + ')' if can else 'across machines'}; "
            "run the target on one machine or choose a family with shard() or pipeline() "
            "(llama, qwen2, qwen3, ministral3, qwen3_5, deepseek_v3, ...).")
    size = group.size()
    if sharding == "tensor":
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = config.get(key)
            if heads and heads % size:
                raise ValueError(f"The target's {key} ({heads}) does not divide among {size} "
                                 "ranks; launch a number of ranks that divides it, or shard "
                                 "with pipelining.")
    elif len(model.model.layers) < size:
        raise ValueError(f"The target has {len(model.model.layers)} layers, fewer than the "
                         f"{size} ranks of the pipeline; launch fewer ranks.")
    return sharding


def _sharded_load(directory: Path, group, sharding: str):
    from mlx_lm.utils import sharded_load

    if sharding == "pipeline" and not (directory / "model.safetensors.index.json").exists():
        _write_index(directory)
    try:
        if sharding == "tensor":
            return sharded_load(str(directory), tensor_group=group)
        return sharded_load(str(directory), pipeline_group=group)
    except ValueError:
        raise
    except Exception as exc:  # unreadable weights, a missing tokenizer
        raise ValueError(f"Could not load the target '{directory}' sharded: "
                         f"{type(exc).__name__}: {exc}") from exc


def _write_index(directory: Path) -> None:
    """mlx-lm's pipeline loading reads the weight index; a one-file model has none."""
    files = sorted(directory.glob("model*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"The target '{directory}' has no model.safetensors.index.json; "
                         "convert it with mlx_lm.convert first.")
    names = mx.load(str(files[0])).keys()
    index = {"metadata": {}, "weight_map": {name: files[0].name for name in names}}
    # Every rank on this machine may write it while another reads it: write a file of
    # one's own, then rename it into place, so a reader sees no index or a whole one.
    # (Written in place, a rank once read it empty: "Expecting value: line 1 column 1".)
    own = directory / f".model.safetensors.index.json.{os.getpid()}.tmp"
    try:
        own.write_text(json.dumps(index))
        os.replace(own, directory / "model.safetensors.index.json")
    except OSError as exc:
        raise ValueError(f"The target '{directory}' has no weight index and it cannot be "
                         f"written ({exc.strerror}); convert it with mlx_lm.convert first.") from None
