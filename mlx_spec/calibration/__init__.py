"""A per-machine calibration cache: what plain decoding, verify passes and draft steps cost here.

    save_calibration(cal)                                    # cache_dir()/calibration/<key>.json
    cal = load_calibration(target_model)                     # None when none, stale or another's
    cal.plain_step_s, cal.verify_seconds(5), cal.draft(draft_model)

This package stores and reads calibrations; it measures nothing. The
measuring is `mlx_spec.bench.calibrate.calibrate` (`mlx-spec tune` runs it
from the command line). The adaptive policy reads a stored calibration to
start from measured costs instead of guesses. A calibration is keyed by the
machine (machine.py), the MLX device and version, the file format, and the
target's weights and dtype (key.py); drafts are stored inside it by
fingerprint.
"""

from .key import (FORMAT_VERSION, calibration_key, dflash_key, eagle3_key, model_dtype,
                  model_fingerprint, mtp_key)
from .record import Calibration, DraftCost, describe
from .store import (MAX_AGE_DAYS, cache_dir, calibration_path, forget_calibration,
                    load_calibration, save_calibration)

__all__ = ["Calibration", "DraftCost", "model_fingerprint", "model_dtype",
           "calibration_key", "dflash_key", "eagle3_key", "mtp_key", "calibration_path", "cache_dir", "save_calibration",
           "load_calibration", "forget_calibration", "describe", "MAX_AGE_DAYS",
           "FORMAT_VERSION"]
