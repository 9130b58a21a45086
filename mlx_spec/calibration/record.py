"""The calibration record: what was measured, as frozen dataclasses and as checked JSON.

`from_dict` trusts nothing in a file: every field must be there with its
type, every time positive and finite, every acceptance in [0, 1]. A file
that fails raises `CorruptCalibration`, which the store turns into one
sentence naming the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Dict, Optional

from ..costmodel import interpolate


KIND_NAMES = {dict: "an object", Real: "a number", object: "a value"}
ROUND_K = 2  # drafts per round of the real rounds a calibration times


class CorruptCalibration(ValueError):
    """A stored calibration that cannot be read back (says which field, not which file)."""


@dataclass(frozen=True)
class DraftCost:
    step_s: float  # one draft step: forward over 1 token + sample, evaluated (a DFlash
    # drafter, "dflash:" key: 0, its one block pass per round is in round_s)
    acceptance: Optional[float]  # greedy per-draft acceptance at k = 4 (i.i.d. MLE), or None
    # the same at T = 1 with the exact rule (None: not measured, e.g. an older file)
    sampling_acceptance: Optional[float] = None
    # seconds a round costs more at T = 1 than greedy (sampling the drafts, the exact
    # rule's graph), measured on real rounds at k = 2 (None: not measured)
    sampling_extra_s: Optional[float] = None
    # seconds of a real greedy round drafting ROUND_K tokens, timed interleaved with the
    # plain step (None: an older file). The policy's prior is anchored to it: the parts
    # above, timed one after another, drift with the machine's load.
    round_s: Optional[float] = None

    def acceptance_at(self, temp: float) -> Optional[float]:
        """A prior for the per-draft acceptance at temperature `temp` (None: not measured).

        Measured at T = 0 and T = 1; in between, the straight line (acceptance
        falls as sampling spreads the target's choices over more tokens); at
        T > 1, the T = 1 value.
        """
        if temp <= 0 or self.acceptance is None or self.sampling_acceptance is None:
            return self.acceptance if temp <= 0 else self.sampling_acceptance
        t = min(temp, 1.0)
        return (1.0 - t) * self.acceptance + t * self.sampling_acceptance


@dataclass(frozen=True)
class Calibration:
    key: dict  # see key.calibration_key: machine, MLX device and version, target weights, dtype
    created: float  # time.time() when measured
    plain_step_s: float  # seconds per token of plain decoding through mlx-spec's loop (median)
    verify_s: Dict[int, float]  # T -> one target forward over T tokens (log-softmax included)
    drafts: Dict[str, DraftCost] = field(default_factory=dict)  # draft fingerprint -> costs

    def draft(self, draft_model) -> Optional[DraftCost]:
        """This draft's costs, if it was measured with this target."""
        from .key import model_fingerprint

        return self.drafts.get(model_fingerprint(draft_model))

    def verify_seconds(self, t: int) -> float:
        """One target forward over t >= 1 tokens (linear between measured T, beyond the ends)."""
        if t < 1:
            raise ValueError(f"t must be an int >= 1; got {t!r}.")
        return interpolate(self.verify_s, t)

    def as_dict(self) -> dict:
        return {
            "key": dict(self.key), "created": self.created, "plain_step_s": self.plain_step_s,
            "verify_s": {str(t): s for t, s in sorted(self.verify_s.items())},
            "drafts": {fp: {"step_s": d.step_s, "acceptance": d.acceptance,
                            "sampling_acceptance": d.sampling_acceptance,
                            "sampling_extra_s": d.sampling_extra_s, "round_s": d.round_s}
                       for fp, d in sorted(self.drafts.items())},
        }


def _get(data, name: str, kind, what: str):
    if not isinstance(data, dict) or name not in data:
        raise CorruptCalibration(f"no {what}")
    value = data[name]
    if not isinstance(value, kind) or (kind is Real and isinstance(value, bool)):
        raise CorruptCalibration(f"{what} is not {KIND_NAMES[kind]}")
    return value


def _seconds(data, name: str, what: str) -> float:
    value = _get(data, name, Real, what)
    if not math.isfinite(value) or value <= 0:
        raise CorruptCalibration(f"{what} is not a positive number of seconds")
    return float(value)


def _acceptance(value) -> Optional[float]:
    if value is None:
        return None
    if not isinstance(value, Real) or isinstance(value, bool) or not 0 <= value <= 1:
        raise CorruptCalibration("a draft's acceptance is not in [0, 1]")
    return float(value)


def _extra(value) -> Optional[float]:
    if value is None:
        return None
    if not isinstance(value, Real) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise CorruptCalibration("a draft's sampling_extra_s is not a number of seconds >= 0")
    return float(value)


def _step(data, fingerprint: str) -> float:
    """A draft's step seconds (> 0), or 0 for a DFlash drafter's (no per-token step)."""
    if fingerprint.startswith("dflash:") and data.get("step_s") == 0:
        return 0.0
    return _seconds(data, "step_s", "a draft's step_s")


def _optional_seconds(data, name: str, what: str) -> Optional[float]:
    return None if data.get(name) is None else _seconds(data, name, what)  # absent: older file


def _length(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # "²" is a digit, not an int
        raise CorruptCalibration(f"verify length {text!r} is not a positive int")
    return int(text)


def key_of(data) -> dict:
    return _get(data, "key", dict, "key")


def from_dict(data) -> Calibration:
    """The calibration a JSON object describes; CorruptCalibration when it does not."""
    verify = _get(data, "verify_s", dict, "verify_s")
    drafts = _get(data, "drafts", dict, "drafts")
    if not verify:
        raise CorruptCalibration("verify_s is empty")
    return Calibration(
        key=key_of(data),
        created=float(_get(data, "created", Real, "creation time")),
        plain_step_s=_seconds(data, "plain_step_s", "plain_step_s"),
        verify_s={_length(t): _seconds(verify, t, f"verify_s[{t}]") for t in verify},
        drafts={fp: DraftCost(_step(d, fp),
                              _acceptance(_get(d, "acceptance", object, "a draft's acceptance")),
                              _acceptance(d.get("sampling_acceptance")),  # absent: older file
                              _extra(d.get("sampling_extra_s")),
                              _optional_seconds(d, "round_s", "a draft's round_s"))
                for fp, d in drafts.items()},
    )


SHOWN_LENGTHS = (2, 4, 8, 16, 32)


def describe(cal: Calibration, draft_fingerprint: Optional[str] = None) -> str:
    """A short table: plain step, verify cost relative to T = 1, each draft's cost and acceptance."""
    one = cal.verify_seconds(1)
    curve = "  ".join(f"T={t} {cal.verify_seconds(t) / one:.2f}x" for t in SHOWN_LENGTHS)
    lines = [
        f"plain decoding step   {cal.plain_step_s * 1e3:8.2f} ms",
        f"target forward, T=1   {one * 1e3:8.2f} ms",
        f"verify cost vs T=1    {curve}",
    ]
    for fp, draft in cal.drafts.items():
        mark = " (this draft)" if fp == draft_fingerprint else ""
        acceptance = "not measured" if draft.acceptance is None else f"{draft.acceptance:.3f}"
        if draft.sampling_acceptance is not None:
            acceptance += f" (T=0), {draft.sampling_acceptance:.3f} (T=1)"
        if draft.round_s is not None:
            acceptance += f"; a greedy round at k={ROUND_K} {draft.round_s * 1e3:.2f} ms"
        if draft.sampling_extra_s is not None:
            acceptance += f"; a round at T=1 costs {draft.sampling_extra_s * 1e3:.2f} ms more"
        if fp.startswith("dflash:"):  # one pass per round, whatever k: timed within the round
            lines.append(f"DFlash drafter {fp[7:19]}{mark}: one block pass per round, "
                         f"acceptance (k=4) {acceptance}")
            continue
        name = f"MTP layer {fp[4:16]}" if fp.startswith("mtp:") else \
            f"EAGLE-3 head {fp[7:19]}" if fp.startswith("eagle3:") else f"draft {fp[:12]}"
        lines.append(f"{name}{mark}: step {draft.step_s * 1e3:.2f} ms = "
                     f"{draft.step_s / one:.3f} target forwards, acceptance (k=4) {acceptance}")
    if not cal.drafts:
        lines.append("no draft measured")
    return "\n".join(lines)
