"""A GGUF file -> (mlx-lm model, mlx-lm tokenizer), with a report of what was done to each tensor.

    model, tokenizer, report = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    print(report.summary())

The model is the mlx-lm class of the file's architecture (so every cache kind,
drafter and server path treats it as any other mlx-lm model); the tokenizer
is built from the file's own vocabulary and chat template.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .config import NORM_PLUS_ONE, PERMUTED_QK, architecture, model_config
from .reader import open_gguf
from .weights import IGNORED, convert_tensor, mlx_name, unpermute_rows


@dataclass
class GgufReport:
    """What loading did: the architecture, the config, and how many tensors went each way."""

    path: str
    architecture: str
    config: dict
    conversions: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        ways = "; ".join(f"{count} x {how}" for how, count in sorted(self.conversions.items()))
        return f"{Path(self.path).name}: {self.architecture} -> mlx-lm {self.config['model_type']}; {ways}"


def _dtype(arch: str, name):
    """The float dtype of the converted model: `name` if given, else float32 on MLX's CPU
    backend (its float16 matmuls run in a plain loop: 3.9 s a token for SmolLM2-135M against
    0.1 s in float32 on a 2-core x86), float16 on a GPU, float32 for Gemma everywhere (its
    activations overflow float16, and bfloat16 rounds the quantization scales: 0.08 nats
    of KL on Gemma-3-270M)."""
    import mlx.core as mx

    if name is not None:
        dtype = getattr(mx, name, None) if isinstance(name, str) else name
        if dtype not in (mx.float16, mx.bfloat16, mx.float32):
            raise ValueError(f"Unknown dtype '{name}'; use float16, bfloat16 or float32.")
        return dtype
    if arch.startswith("gemma") or mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return mx.float16


def load_gguf(path, dequantize: bool = False, dtype=None):
    """Load `(model, tokenizer, report)` from a GGUF file.

    dequantize: keep every quantized matrix in the float dtype instead of MLX's
    quantized format. dtype: the float dtype (default: float32 on the CPU and for Gemma,
    float16 on a GPU).
    Raises ValueError with one sentence for a file that cannot be read as a model."""
    import mlx.core as mx

    from .tokenizer import load_tokenizer

    gguf_file = open_gguf(path)
    metadata = gguf_file.metadata
    arch = architecture(metadata)
    tensors = gguf_file.tensors
    if "token_embd.weight" not in tensors:
        raise ValueError(f"'{path}' holds no token embedding (token_embd.weight); it is not a "
                         "complete language model.")
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    config = model_config(metadata, vocab_size, tied="output.weight" not in tensors)
    float_dtype = _dtype(arch, dtype)
    report = GgufReport(str(path), arch, config)

    weights, quantization = {}, {}
    for name, tensor in tensors.items():
        if name in IGNORED:
            continue
        target = mlx_name(name, arch)
        norm_plus_one = arch in NORM_PLUS_ONE and name.endswith("norm.weight")
        converted = convert_tensor(tensor, mx.float32 if norm_plus_one else float_dtype,
                                   dequantize)
        arrays = converted.arrays
        how = converted.how
        if norm_plus_one:
            arrays = {"weight": (arrays["weight"] - 1.0).astype(float_dtype)}
            how = f"{tensor.kind} -> {str(float_dtype).split('.')[-1]} (norm stored as w + 1)"
        if arch in PERMUTED_QK and (".attn_q." in name or ".attn_k." in name):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            arrays = {key: unpermute_rows(value, heads) for key, value in arrays.items()}
        stem = target.rsplit(".", 1)[0]
        suffix = target.rsplit(".", 1)[1]
        for key, value in arrays.items():
            weights[f"{stem}.{key if suffix == 'weight' else suffix}"] = value
        if converted.quantization is not None:
            quantization[stem] = converted.quantization
        report.conversions[how] += 1

    model = _build(config, weights, quantization)
    if "rope_freqs.weight" in tensors:
        _set_rope_frequencies(model, config, tensors["rope_freqs.weight"])
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(metadata)
    return model, tokenizer, report


def _build(config, weights, quantization):
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quantization:
        nn.quantize(model, class_predicate=lambda path, module: quantization.get(path, False))
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ValueError(f"The GGUF file's tensors do not fit an mlx-lm {config['model_type']} "
                         f"model: {exc}") from None
    model.eval()
    return model


def _set_rope_frequencies(model, config, tensor):
    """Llama 3.1+ files carry their RoPE frequency factors (rope_freqs) instead of a scaling config."""
    import mlx.core as mx
    import numpy as np

    factors = tensor.data.view(np.float32).reshape(-1)
    dims = config["head_dim"]
    base = config["rope_theta"]
    freqs = mx.array(base ** (np.arange(0, dims, 2, dtype=np.float32) / dims) * factors)
    for layer in model.model.layers:
        layer.self_attn.rope = FrequencyRoPE(dims, freqs)


class FrequencyRoPE:
    """RoPE with explicit per-pair frequencies (mx.fast.rope's `freqs`), as llama.cpp applies rope_freqs."""

    def __init__(self, dims, freqs):
        self.dims = dims
        self._freqs = freqs

    def __call__(self, x, offset=0):
        import mlx.core as mx

        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)
