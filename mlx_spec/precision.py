"""The dtype a drafter computes in: float32 on MLX's CPU backend, its own dtype elsewhere.

MLX's CPU backend multiplies float16 and bfloat16 matrices in a plain loop,
float32 ones through BLAS: on a 2-core x86 CPU with OpenBLAS the shipped
DFlash drafter's pass at k = 3 costs 12.9 ms in float16 and 4.8 ms in float32
(bench/results/dflash-cost-openblas.md), and greedy decoding of the shipped
float16 target with it went from 1.18x to 1.47x plain at k = 3, the draft
model from 1.25x to 1.39x (docs/benchmarks.md, "Drafters in float32 on the
CPU"). A drafter's dtype never changes what is generated: the acceptance
rule keeps exactly the target's tokens whatever the drafts and q are. So on
the CPU backend a half-precision drafter (a draft model, an MTP layer, a
DFlash drafter) is converted to float32, once, in place, when a call first
drafts with it; the target is never converted (its dtype defines the output).
Quantized drafters and GPUs (Metal, CUDA: half precision is their fast path)
are left as they are. `MLX_SPEC_DRAFT_DTYPE=native` turns the conversion off.

The drafter's rows then meet the target's output head (DFlash, MTP): `head_for`
gives them a float32 copy of a plain half-precision head when that copy is
small (HEAD_COPY_LIMIT), else feeds the head rows in its own dtype, never a
per-round conversion of a large head.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

HALF = (mx.float16, mx.bfloat16)
HEAD_COPY_LIMIT = 256 * 2 ** 20  # bytes of a float32 copy of the target's head, at most
_head_copies: Dict[int, Tuple[mx.array, mx.array]] = {}  # id(weight) -> (weight, copy); 2 kept


def upcasting() -> bool:
    """Whether half-precision drafters compute in float32 here (the CPU backend)."""
    setting = os.environ.get("MLX_SPEC_DRAFT_DTYPE", "auto")
    if setting not in ("auto", "native"):
        raise ValueError(f"MLX_SPEC_DRAFT_DTYPE must be auto or native, got {setting!r}.")
    if setting == "native":  # drafters compute in their own dtype
        return False
    return mx.default_device().type == mx.DeviceType.cpu


def prepare_drafter(module, target=None):
    """`module` (a draft model, an MTP block, a DFlash drafter) converted in place to float32
    when upcasting and all its floating weights are half precision and none is quantized;
    returned either way. Never the `target` itself (a model drafting for itself)."""
    if module is None or module is target or not upcasting() or \
            not isinstance(module, nn.Module):
        return module
    dtypes = {weight.dtype for _, weight in tree_flatten(module.parameters())}
    if dtypes and dtypes <= set(HALF):  # quantized weights (uint32) or float32 ones: as is
        module.set_dtype(mx.float32)
        mx.eval(module.parameters())  # now: a server's worker thread has its own streams
    return module


def compute_dtype(module) -> mx.Dtype:
    """The dtype a drafter's rows come out in: that of its floating weights."""
    for _, weight in tree_flatten(module.parameters()):
        if mx.issubdtype(weight.dtype, mx.floating):
            return weight.dtype
    return mx.float32


def head_for(head: Callable, dtype: mx.Dtype) -> Callable:
    """The target's output head for drafter rows in `dtype`: the head itself when the dtypes
    agree; a float32 copy of a plain half-precision head up to HEAD_COPY_LIMIT bytes; else the
    head fed rows cast to its own dtype."""
    weight, bias, own = _head_weights(head)
    if own is None or own == dtype:
        return head
    if weight is not None and dtype == mx.float32 and weight.size * 4 <= HEAD_COPY_LIMIT:
        copy = _float32_copy(weight)
        if bias is None:
            return lambda x: x @ copy.T
        bias = bias.astype(mx.float32)
        mx.eval(bias)
        return lambda x: mx.addmm(bias, x, copy.T)
    return lambda x: head(x.astype(own))


def _head_weights(head):
    """(plain weight or None, bias or None, the dtype it computes in or None if unknown)."""
    module = getattr(head, "__self__", head)  # a tied head: the embedding's as_linear
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return None, None, module.scales.dtype
    if isinstance(module, (nn.Linear, nn.Embedding)):
        bias = module.bias if isinstance(module, nn.Linear) and "bias" in module else None
        return module.weight, bias, module.weight.dtype
    return None, None, None


def _float32_copy(weight: mx.array) -> mx.array:
    held = _head_copies.get(id(weight))
    if held is not None and held[0] is weight:
        return held[1]
    copy = weight.astype(mx.float32)
    mx.eval(copy)
    while len(_head_copies) >= 2:
        _head_copies.pop(next(iter(_head_copies)))
    _head_copies[id(weight)] = (weight, copy)
    return copy
