"""A per-machine calibration cache: what plain decoding, verify passes and draft steps cost here.

    cal = calibrate(target_model, draft_model, tokenizer)   # a few seconds
    save_calibration(cal)                                    # cache_dir()/calibration/<key>.json
    cal = load_calibration(target_model)                     # None when none, stale or another's
    cal.plain_step_s, cal.verify_seconds(5), cal.draft(draft_model)
    calibrate(target_model, None, tokenizer, mtp=True)      # the target's MTP layer too

`mlx-spec tune` runs it from the command line; the adaptive policy reads it
to start from measured costs instead of guesses. A calibration is keyed by
the machine, the MLX device and version, the file format, and the target's
weights and dtype (key.py); drafts are stored inside it by fingerprint.
"""

from .key import FORMAT_VERSION, calibration_key, model_dtype, model_fingerprint, mtp_key
from .measure import calibrate
from .record import Calibration, DraftCost, describe
from .store import (MAX_AGE_DAYS, cache_dir, calibration_path, forget_calibration,
                    load_calibration, save_calibration)

__all__ = ["Calibration", "DraftCost", "calibrate", "model_fingerprint", "model_dtype",
           "calibration_key", "mtp_key", "calibration_path", "cache_dir", "save_calibration",
           "load_calibration", "forget_calibration", "describe", "MAX_AGE_DAYS",
           "FORMAT_VERSION"]
