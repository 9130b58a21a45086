"""What a calibration is valid for: this machine, this MLX device and version, these weights.

`model_fingerprint(model)` names a model's weights without reading them all:
a hash of its configuration, every parameter's (name, shape, dtype), and 32
values from each of a few tensors. Cheap for a 7B model (the names and
shapes are host metadata; the samples are a few hundred numbers), and a
quantized copy differs from the original (other names, dtypes and values).
"""

from __future__ import annotations

import hashlib
import json
import platform

import mlx.core as mx
from mlx.utils import tree_flatten

from .machine import chip_name, memory_gb

FORMAT_VERSION = 1  # bump when the file's fields change meaning
SAMPLED_TENSORS = 8  # tensors whose values enter the fingerprint, spread over the model
SAMPLED_VALUES = 16  # the first values, then as many spread along the tensor


def _config(model) -> str:
    args = getattr(model, "args", None)
    fields = vars(args) if hasattr(args, "__dict__") else {"args": repr(args)}
    model_type = getattr(model, "model_type", None) or fields.get("model_type")
    return json.dumps({"model_type": model_type, **fields}, sort_keys=True, default=str)


def _samples(weight: mx.array) -> mx.array:
    flat = weight.reshape(-1)
    stride = max(1, flat.size // SAMPLED_VALUES)
    values = mx.concatenate([flat[:SAMPLED_VALUES], flat[::stride][:SAMPLED_VALUES]])
    return values.astype(mx.float32) if mx.issubdtype(values.dtype, mx.floating) else values


def model_fingerprint(model) -> str:
    """A hex digest that is stable for the same weights and differs for other ones."""
    params = sorted(tree_flatten(model.parameters()), key=lambda item: item[0])
    digest = hashlib.sha1(_config(model).encode())
    for name, weight in params:
        digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype};".encode())
    picked = params[:: max(1, len(params) // SAMPLED_TENSORS)][:SAMPLED_TENSORS]
    samples = [_samples(weight) for _, weight in picked if weight.size]
    mx.eval(samples)
    for values in samples:
        digest.update(repr(values.tolist()).encode())
    return digest.hexdigest()


def mtp_key(head) -> str:
    """Where a target's MTP layer is stored among a calibration's drafts: "mtp:" + its weights'."""
    return "mtp:" + model_fingerprint(head.block)


def dflash_key(drafter) -> str:
    """Where a DFlash drafter is stored among a calibration's drafts: "dflash:" + its weights'."""
    return "dflash:" + model_fingerprint(drafter)


def eagle3_key(head) -> str:
    """Where an EAGLE-3 head is stored among a calibration's drafts: "eagle3:" + its weights'."""
    return "eagle3:" + model_fingerprint(head)


def model_dtype(model) -> str:
    """The floating dtype holding most of the model's parameters ('float16', 'bfloat16', ...)."""
    counts = {}
    for _, weight in tree_flatten(model.parameters()):
        if mx.issubdtype(weight.dtype, mx.floating):
            name = str(weight.dtype).removeprefix("mlx.core.")
            counts[name] = counts.get(name, 0) + weight.size
    return max(counts, key=counts.get) if counts else "none"


def device_name() -> str:
    """MLX's default device, with the device's own name where MLX reports one."""
    try:
        name = mx.device_info().get("device_name", "")
    except (AttributeError, RuntimeError):  # older MLX, or no device info on this backend
        name = ""
    device = str(mx.default_device())
    return f"{device} ({name})" if name else device


def calibration_key(target_model) -> dict:
    """Everything a calibration depends on; a stored one is used only when its key is equal."""
    return {
        "format": FORMAT_VERSION,
        "mlx": mx.__version__,
        "system": platform.system(),
        "arch": platform.machine(),
        "chip": chip_name(),
        "memory_gb": round(memory_gb(), 1),
        "device": device_name(),
        "target": model_fingerprint(target_model),
        "target_dtype": model_dtype(target_model),
    }
