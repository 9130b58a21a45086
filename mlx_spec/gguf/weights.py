"""GGUF tensors -> MLX arrays under mlx-lm's parameter names.

Each tensor goes one of three ways, and the loader reports which:
- float (F32, F16, BF16): cast to the model's dtype;
- the types whose blocks are affine over 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and
  the 32-value sub-blocks of Q4_K and Q5_K): repacked bit for bit into MLX's affine
  format (group 32; a block's values are d * q + m, which is MLX's scale * q + bias):
  nothing is lost;
- the rest (K-quants, IQ types, ...): dequantized by the `gguf` package and quantized
  again with `mx.quantize` at group 32 and the bits in REQUANT_BITS (or kept in the
  float dtype when asked).

Two layouts of llama.cpp's are undone here: Q/K rows permuted for its RoPE
(llama family) and Gemma's norm weights stored as w + 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

GROUP_SIZE = 32

# GGUF type -> MLX bits after dequantizing; types whose blocks are finer than 32 values
# (Q2_K, Q3_K, Q6_K: 16) get one more bit (Q6_K: 8, MLX has no 7-bit format).
REQUANT_BITS = {
    "Q2_K": 3, "Q3_K": 4, "Q6_K": 8, "Q8_K": 8, "Q8_1": 8,
    "IQ1_S": 4, "IQ1_M": 4, "IQ2_XXS": 4, "IQ2_XS": 4, "IQ2_S": 4, "IQ3_XXS": 4,
    "IQ3_S": 4, "IQ4_NL": 4, "IQ4_XS": 4, "TQ1_0": 4, "TQ2_0": 4, "MXFP4": 4,
}

FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass
class MlxTensor:
    """One converted tensor: its arrays by suffix (weight, scales, biases) and what was done."""

    arrays: dict
    how: str
    quantization: Optional[dict] = None  # {"group_size", "bits"} for a quantized matrix


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Integers in [0, 2**bits) -> MLX's packing: one little-endian bit stream per row, in uint32.

    Every 32 values fill `bits` words exactly; a value may straddle two words."""
    rows, n = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view("<u4")
    if bits == 4:
        q = q.astype(np.uint8)
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view("<u4")
    values = q.reshape(rows, n // 32, 32).astype(np.uint32)
    words = np.zeros((rows, n // 32, bits), dtype=np.uint32)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        words[..., word] |= values[..., i] << np.uint32(shift)  # the high bits fall off
        if shift + bits > 32:
            words[..., word + 1] |= values[..., i] >> np.uint32(32 - shift)
    return words.reshape(rows, n // 32 * bits)


def _f16(blocks, start):
    return blocks[:, start:start + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs):
    """16 bytes -> 32 values: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(blocks, start):
    qh = blocks[:, start:start + 4].copy().view("<u4")[:, 0]
    return ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def affine_blocks(data: np.ndarray, kind: str):
    """(q, scale, bias) of a block-32 affine type, one block per row of 32 values.

    Every block stores values d * (q - offset) or d * q + m with integer q; these
    are MLX's scale * q + bias exactly."""
    blocks = data.reshape(-1, _BLOCK_BYTES[kind])
    d = _f16(blocks, 0)
    if kind == "Q8_0":
        q = blocks[:, 2:34].view(np.int8).astype(np.int16) + 128
        return q.astype(np.uint8), d, -128.0 * d
    if kind == "Q4_0":
        return _nibbles(blocks[:, 2:18]), d, -8.0 * d
    if kind == "Q4_1":
        return _nibbles(blocks[:, 4:20]), d, _f16(blocks, 2)
    if kind == "Q5_0":
        return _nibbles(blocks[:, 6:22]) | _fifth_bits(blocks, 2), d, -16.0 * d
    if kind == "Q5_1":
        return _nibbles(blocks[:, 8:24]) | _fifth_bits(blocks, 4), d, _f16(blocks, 2)
    raise KeyError(kind)


def _k_scales(scales):
    """Q4_K/Q5_K: 12 bytes -> the 6-bit scale and min of each of 8 sub-blocks."""
    low, high = scales[:, :4], scales[:, 4:8]
    sc = np.concatenate([low & 63, (scales[:, 8:12] & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([high & 63, (scales[:, 8:12] >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def k_blocks(data: np.ndarray, kind: str):
    """(q, scale, bias) of Q4_K or Q5_K, one 32-value sub-block per row.

    A 256-value super-block holds 8 sub-blocks whose values are d * sc * q - dmin * m:
    MLX's scale * q + bias with scale = d * sc and bias = -dmin * m."""
    blocks = data.reshape(-1, _BLOCK_BYTES[kind])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    if kind == "Q4_K":
        qs, qh = blocks[:, 16:144].reshape(-1, 4, 32), None
    else:
        qh, qs = blocks[:, 16:48], blocks[:, 48:176].reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2)  # (blocks, chunk, low/high, 32)
    if qh is not None:
        shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
        q = q | (((qh[:, None, None, :] >> shifts) & 1) << 4)
    return (q.reshape(-1, 32), (d[:, None] * sc).reshape(-1), (-dmin[:, None] * mn).reshape(-1))


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
                "Q5_K": 176}
_AFFINE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}


def _rows_shape(tensor):
    """(rows, columns, shape) of a tensor as MLX lays it out (GGUF lists dimensions innermost first)."""
    dims = [int(d) for d in tensor.shape]
    rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
    return rows, dims[0], list(reversed(dims))


_FLOAT_VIEWS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def convert_tensor(tensor, dtype, dequantize: bool = False) -> MlxTensor:
    """One GGUF tensor (reader.GgufTensor) -> MLX arrays in `dtype` (an mx float dtype)."""
    import mlx.core as mx
    from gguf import quants

    kind = tensor.kind
    rows, columns, shape = _rows_shape(tensor)
    raw = tensor.data
    if kind in FLOAT_TYPES:
        if kind == "BF16":
            array = mx.array(raw.view(np.uint16).reshape(shape)).view(mx.bfloat16)
        else:
            array = mx.array(raw.view(_FLOAT_VIEWS[kind]).reshape(shape))
        return MlxTensor({"weight": array.astype(dtype)}, f"{kind} -> {_name(dtype)}")
    if len(shape) != 2:
        raise ValueError(f"Tensor '{tensor.name}' is quantized ({kind}) with {len(shape)} "
                         "dimensions; only matrices are supported.")
    if kind in _AFFINE_BITS and not dequantize:
        bits = _AFFINE_BITS[kind]
        q, scale, bias = (k_blocks if kind.endswith("_K") else affine_blocks)(raw, kind)
        weight = pack_bits(q.reshape(rows, columns), bits)
        groups = columns // GROUP_SIZE
        return MlxTensor(
            {"weight": mx.array(weight),
             "scales": mx.array(scale.reshape(rows, groups)).astype(dtype),
             "biases": mx.array(bias.reshape(rows, groups)).astype(dtype)},
            f"{kind} kept ({bits}-bit, group {GROUP_SIZE}, repacked exactly)",
            {"group_size": GROUP_SIZE, "bits": bits})
    try:
        values = quants.dequantize(raw.reshape(rows, -1), tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"Tensor '{tensor.name}' uses the GGUF type {kind}, which cannot be "
                         "dequantized here; re-export the model with another type.") from None
    values = mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(rows, columns))
    if dequantize or columns % GROUP_SIZE:
        return MlxTensor({"weight": values.astype(dtype)}, f"{kind} -> {_name(dtype)} (dequantized)")
    bits = _AFFINE_BITS.get(kind) or REQUANT_BITS.get(kind, 8)
    weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=bits)
    return MlxTensor(
        {"weight": weight, "scales": scales.astype(dtype), "biases": biases.astype(dtype)},
        f"{kind} -> {bits}-bit, group {GROUP_SIZE} (dequantized and re-quantized)",
        {"group_size": GROUP_SIZE, "bits": bits})


def _name(dtype) -> str:
    return str(dtype).split(".")[-1]


# llama.cpp tensor names -> mlx-lm parameter names (before the .weight / .bias suffix)
_COMMON = [
    (r"^token_embd$", "model.embed_tokens"),
    (r"^output_norm$", "model.norm"),
    (r"^output$", "lm_head"),
    (r"^blk\.(\d+)\.attn_q$", r"model.layers.\1.self_attn.q_proj"),
    (r"^blk\.(\d+)\.attn_k$", r"model.layers.\1.self_attn.k_proj"),
    (r"^blk\.(\d+)\.attn_v$", r"model.layers.\1.self_attn.v_proj"),
    (r"^blk\.(\d+)\.attn_output$", r"model.layers.\1.self_attn.o_proj"),
    (r"^blk\.(\d+)\.attn_q_norm$", r"model.layers.\1.self_attn.q_norm"),
    (r"^blk\.(\d+)\.attn_k_norm$", r"model.layers.\1.self_attn.k_norm"),
    (r"^blk\.(\d+)\.ffn_gate$", r"model.layers.\1.mlp.gate_proj"),
    (r"^blk\.(\d+)\.ffn_up$", r"model.layers.\1.mlp.up_proj"),
    (r"^blk\.(\d+)\.ffn_down$", r"model.layers.\1.mlp.down_proj"),
    (r"^blk\.(\d+)\.attn_norm$", r"model.layers.\1.input_layernorm"),
]
_NORMS = {
    "gemma3": [
        (r"^blk\.(\d+)\.post_attention_norm$", r"model.layers.\1.post_attention_layernorm"),
        (r"^blk\.(\d+)\.ffn_norm$", r"model.layers.\1.pre_feedforward_layernorm"),
        (r"^blk\.(\d+)\.post_ffw_norm$", r"model.layers.\1.post_feedforward_layernorm"),
    ],
}
_DEFAULT_NORMS = [(r"^blk\.(\d+)\.ffn_norm$", r"model.layers.\1.post_attention_layernorm")]
# Tensors llama.cpp keeps for its own use; the mlx-lm model computes them itself.
IGNORED = {"rope_freqs.weight"}


def mlx_name(gguf_name: str, arch: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (ValueError if unknown)."""
    stem, _, suffix = gguf_name.rpartition(".")
    for pattern, replacement in _COMMON + _NORMS.get(arch, _DEFAULT_NORMS):
        if re.match(pattern, stem):
            return re.sub(pattern, replacement, stem) + "." + suffix
    raise ValueError(f"The GGUF tensor '{gguf_name}' has no place in a {arch} model; the file "
                     "is not a plain text model of that architecture.")


def unpermute_rows(array, n_head: int):
    """Undo llama.cpp's Q/K row permutation (its `permute`) on a matrix or its scales/biases.

    llama.cpp stores, per head, the rotary pairs interleaved (x0, x_{d/2}, x1, ...);
    the Hugging Face layout keeps the two halves apart."""
    rows = array.shape[0]
    rest = tuple(array.shape[1:])
    head_dim = rows // n_head
    return (array.reshape((n_head, head_dim // 2, 2) + rest)
            .swapaxes(1, 2).reshape((rows,) + rest))
