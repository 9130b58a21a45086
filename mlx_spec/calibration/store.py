"""Where calibrations live, and when a stored one is used.

One JSON file per key (machine, MLX device and version, format, target
weights and dtype) under `cache_dir()/calibration/`. A file is ignored
(`load_calibration` gives None) when it is stale: another MLX or format
version, or older than MAX_AGE_DAYS; or when its key is not this model's on
this machine. A file that cannot be read back is an error naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from .record import Calibration, CorruptCalibration, from_dict, key_of

MAX_AGE_DAYS = 30
STALE_FIELDS = ("format", "mlx")  # a change here voids a calibration whatever else holds


def cache_dir() -> Path:
    """$MLX_SPEC_CACHE_DIR, else $XDG_CACHE_HOME/mlx-spec, else ~/.cache/mlx-spec."""
    if os.environ.get("MLX_SPEC_CACHE_DIR"):
        return Path(os.environ["MLX_SPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx-spec"


def _path_for(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def calibration_path(target_model) -> Path:
    """The file a calibration of `target_model` on this machine is stored in."""
    from .key import calibration_key

    return _path_for(calibration_key(target_model))


def _corrupt(path: Path, reason: str) -> ValueError:
    return ValueError(f"The calibration file {path} cannot be read ({reason}); delete it or "
                      "run `mlx-spec tune` again.")


def _read(path: Path) -> Optional[dict]:
    """The file's JSON object, None when there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise _corrupt(path, type(exc).__name__) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _corrupt(path, f"not JSON: {exc.msg} at line {exc.lineno}") from None


def is_stale(cal: Calibration, key: dict, now: Optional[float] = None) -> bool:
    """Measured with other software, too long ago, or for another model or machine."""
    age_days = ((now or time.time()) - cal.created) / 86400
    return cal.key != key or age_days > MAX_AGE_DAYS


def load_calibration(target_model) -> Optional[Calibration]:
    """The stored calibration for `target_model` on this machine, or None (none, or stale).

    Raises ValueError (one sentence naming the file) when the file is corrupt.
    """
    from .key import calibration_key

    key = calibration_key(target_model)
    path = _path_for(key)
    data = _read(path)
    if data is None:
        return None
    try:
        stored_key = key_of(data)
        if any(stored_key.get(name) != key[name] for name in STALE_FIELDS):
            return None  # a later format may have other fields: do not judge them
        cal = from_dict(data)
    except CorruptCalibration as exc:
        raise _corrupt(path, str(exc)) from None
    return None if is_stale(cal, key) else cal


def save_calibration(cal: Calibration) -> Path:
    """Write `cal` atomically, keeping drafts measured earlier for the same key (newest wins)."""
    path = _path_for(cal.key)
    try:
        data = _read(path)
        old = from_dict(data) if data is not None else None
    except ValueError:  # CorruptCalibration included
        old = None  # a corrupt file is what `mlx-spec tune` replaces
    if old is not None and not is_stale(old, cal.key, now=cal.created):
        cal = dataclasses.replace(cal, drafts={**old.drafts, **cal.drafts})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal.as_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def forget_calibration(target_model) -> Optional[Path]:
    """Delete the stored calibration for `target_model`; the path deleted, or None."""
    path = calibration_path(target_model)
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path
