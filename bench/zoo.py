"""A zoo of target/draft pairs built from the shipped pair: no downloads, seconds to build.

Each pair stresses speculation differently, so that "mlx-spec is never
behind" is checked where a draft pays, where it cannot, and in between:

- shipped-f16: the shipped target and draft as stored (float16);
- shipped-f32: both cast to float32 (on the CPU, float32 products go to BLAS);
- weak: the shipped target with a random-initialised draft of the shipped
  draft's shape (same vocabulary, no skill): acceptance near zero;
- strong: the shipped target with itself quantized to 4 bits as the draft:
  high acceptance, and a draft step is a full-depth forward. The copy is cast
  to float32 before quantizing: MLX's CPU quantized product with float16
  scales measured 37x slower than the dense float16 product (a draft ten
  times dearer than its target), with float32 scales it is fast.

The policy was tuned on those four and on noisy-f32, a float32 pair with a
weak-but-not-useless draft like the one a user reported. The held-out pairs
are only measured, never tuned on (docs/benchmarks.md), and are unlike the
shipped pair:

- skip-f32: the shipped target in float32, drafting with its own first two
  layers, norm and head (an early exit: a third of a target step per draft);
- noisy-f16: the slow float16 target with a noisier copy of the shipped draft;
- hybrid-f32: a random Gated-DeltaNet hybrid target (mlx-lm's qwen3_5 class,
  recurrent and attention layers; nothing to trim, so mlx-lm refuses it),
  its 8-bit copy as the draft;
- sliding-f32: a random sliding-window target (gemma3_text, window 16, so
  the caches rotate within a run) with its 4-bit copy as the draft;
- mtp-f32: the shipped target in float32 with its shipped MTP head.

Two more held-out pairs were added after the policy's first look (2026-12-03),
which was designed looking at the hybrid, sliding and MTP rows above; these
two had never been measured when it was made:

- skip-f16: the slow float16 target drafting with its own first two layers;
- hybrid-skip-f32: the random hybrid target drafting with its own first three
  layers (two recurrent, one attention): a draft at half a target step whose
  recurrent state is rewound by checkpoints.

One more held-out pair was added after the greedy prompt look
(policy.GREEDY_LOOK, 2026-12-05) was made from the tuned half; it had never
been measured when it was made:

- sliding-skip-f32: the random sliding-window target drafting with its own
  first three layers (two sliding-window, one global): rotating caches in the
  draft too.

Two more pairs are not in the zoo's halves (the never-behind tables): studies
name them to measure the shipped DFlash block drafter (EXTRA_BUILDERS):

- dflash-f16 / dflash-f32: the shipped target as stored / in float32 with the
  shipped DFlash drafter (mlx_spec/default_models/dflash).

The random targets use the shipped tokenizer's vocabulary, untied output
heads and weights scaled up (as the tests' tiny models) so their text depends
on the context.

Every pair gets freshly loaded models, so casting or quantizing one pair
never touches another's weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma3_text, llama, qwen3_5

from mlx_spec.dflash import load_dflash
from mlx_spec.loading import default_draft_path, default_target_path, load

WEAK_DRAFT_SEED = 3
STRONG_DRAFT_GROUP_SIZE, STRONG_DRAFT_BITS = 32, 4
STRONG_DRAFT_DTYPE = mx.float32  # of the scales and activations; see the module docstring
NOISY_F32_NOISE, NOISY_F16_NOISE = 0.25, 0.35  # Gaussian noise on the draft, in each weight's std
SKIP_LAYERS = 2  # the early-exit draft's layers
RANDOM_TARGET = dict(hidden=256, layers=6, seed=11, scale=3.0, window=16)
HYBRID_DRAFT_BITS, SLIDING_DRAFT_BITS = 8, 4
HYBRID_SKIP_LAYERS = 3  # the hybrid early exit: layers 0-2 (two recurrent, one full attention)
SLIDING_SKIP_LAYERS = 3  # the sliding early exit: layers 0-2 (two sliding-window, one global)


@dataclass(frozen=True)
class Pair:
    name: str
    target_model: object
    draft_model: object
    tokenizer: object
    note: str
    held_out: bool = False  # only measured: the policy is never tuned on it
    draft_options: Dict[str, object] = dataclasses.field(default_factory=dict)


def _shipped():
    """(target, draft, tokenizer): fresh float16 copies of the shipped pair."""
    target_model, tokenizer = load(str(default_target_path()))
    draft_model, _ = load(str(default_draft_path()))
    return target_model, draft_model, tokenizer


def random_draft(like, seed: int = WEAK_DRAFT_SEED, dtype=mx.float16):
    """A llama of `like`'s shape and vocabulary with random weights and untied embeddings."""
    args = dataclasses.replace(like.args, tie_word_embeddings=False)
    mx.random.seed(seed)
    draft_model = llama.Model(args)
    draft_model.set_dtype(dtype)
    mx.eval(draft_model.parameters())
    return draft_model


def quantized_copy(path: str, group_size: int = STRONG_DRAFT_GROUP_SIZE,
                   bits: int = STRONG_DRAFT_BITS, dtype=STRONG_DRAFT_DTYPE):
    """A fresh copy of the model at `path`, cast to `dtype`, its linear and embedding layers
    quantized."""
    model, _ = load(path)
    model.set_dtype(dtype)
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def _shipped_f16() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    return Pair("shipped-f16", target_model, draft_model, tokenizer,
                "the shipped target and draft as stored (float16)")


def _shipped_f32() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    target_model.set_dtype(mx.float32)
    draft_model.set_dtype(mx.float32)
    mx.eval(target_model.parameters(), draft_model.parameters())
    return Pair("shipped-f32", target_model, draft_model, tokenizer,
                "the shipped pair cast to float32")


def _weak() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    return Pair("weak", target_model, random_draft(draft_model), tokenizer,
                f"shipped float16 target; random draft of the shipped draft's shape "
                f"(seed {WEAK_DRAFT_SEED}): acceptance near zero")


def _strong() -> Pair:
    target_model, _, tokenizer = _shipped()
    draft_model = quantized_copy(str(default_target_path()))
    return Pair("strong", target_model, draft_model, tokenizer,
                f"shipped float16 target; the target itself quantized to {STRONG_DRAFT_BITS} "
                f"bits (group {STRONG_DRAFT_GROUP_SIZE}, float32 scales) as the draft")


def noisy_copy(model, noise: float, seed: int = 1):
    """`model` plus Gaussian noise of `noise` times each weight's standard deviation, in place."""
    key = mx.random.key(seed)
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(flat))
    noisy = [(name, w + (noise * mx.std(w.astype(mx.float32)).item()
                         * mx.random.normal(w.shape, key=keys[i])).astype(w.dtype))
             if w.size > 1 else (name, w) for i, (name, w) in enumerate(flat)]
    model.load_weights(noisy)
    mx.eval(model.parameters())
    return model


def _as_f32(*models):
    for model in models:
        model.set_dtype(mx.float32)
    mx.eval([m.parameters() for m in models])


def _noisy_f32() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    _as_f32(target_model, draft_model)
    return Pair("noisy-f32", target_model, noisy_copy(draft_model, NOISY_F32_NOISE), tokenizer,
                f"the shipped pair in float32, the draft's weights plus Gaussian noise "
                f"({NOISY_F32_NOISE} std): a weak draft for a fast target")


def shallow_copy(target_model, shallow_model, layers: int):
    """`shallow_model` (the target's class with `layers` layers) given the target's first
    `layers` layers, embedding, final norm and head: an early exit of any family."""
    kept = [(name, w) for name, w in tree_flatten(target_model.parameters())
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < layers]
    shallow_model.load_weights(kept)
    mx.eval(shallow_model.parameters())
    return shallow_model


def early_exit(target_model, layers: int):
    """A llama of the target's first `layers` layers, then its final norm and output head."""
    args = target_model.args
    return shallow_copy(target_model, llama.Model(dataclasses.replace(
        args, num_hidden_layers=layers,
        layer_types=args.layer_types[:layers] if args.layer_types else None)), layers)


def _skip_f32() -> Pair:
    target_model, _, tokenizer = _shipped()
    _as_f32(target_model)
    draft_model = early_exit(target_model, SKIP_LAYERS)
    return Pair("skip-f32", target_model, draft_model, tokenizer,
                f"the shipped target in float32; its first {SKIP_LAYERS} layers, norm and head "
                f"as the draft (an early exit)", held_out=True)


def _skip_f16() -> Pair:
    target_model, _, tokenizer = _shipped()
    return Pair("skip-f16", target_model, early_exit(target_model, SKIP_LAYERS), tokenizer,
                f"the shipped float16 target; its first {SKIP_LAYERS} layers, norm and head "
                f"as the draft (an early exit)", held_out=True)


def _noisy_f16() -> Pair:
    target_model, draft_model, tokenizer = _shipped()
    return Pair("noisy-f16", target_model, noisy_copy(draft_model, NOISY_F16_NOISE), tokenizer,
                f"the shipped float16 pair, the draft's weights plus Gaussian noise "
                f"({NOISY_F16_NOISE} std): a weak draft for a slow target", held_out=True)


def _scaled(model):
    """Float32, every matrix scaled up (so a random model's text depends on its context)."""
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda w: w * RANDOM_TARGET["scale"] if w.ndim >= 2 else w,
                          model.parameters()))
    model.eval()
    mx.eval(model.parameters())
    return model


def _random_hybrid(vocab_size: int, layers: int = RANDOM_TARGET["layers"]):
    h = RANDOM_TARGET["hidden"]
    mx.random.seed(RANDOM_TARGET["seed"])
    return _scaled(qwen3_5.Model(qwen3_5.ModelArgs.from_dict({
        "model_type": "qwen3_5", "hidden_size": h, "intermediate_size": 3 * h,
        "num_hidden_layers": layers, "full_attention_interval": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25}})))


def _random_sliding(vocab_size: int, layers: int = RANDOM_TARGET["layers"]):
    h = RANDOM_TARGET["hidden"]
    mx.random.seed(RANDOM_TARGET["seed"])
    return _scaled(gemma3_text.Model(gemma3_text.ModelArgs.from_dict({
        "model_type": "gemma3_text", "hidden_size": h, "num_hidden_layers": layers,
        "intermediate_size": 3 * h, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "query_pre_attn_scalar": 64, "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "sliding_window": RANDOM_TARGET["window"], "sliding_window_pattern": 3,
        "max_position_embeddings": 4096})))


def _random_pair(name: str, build, bits: int, note: str) -> Pair:
    _, _, tokenizer = _shipped()
    vocab_size = len(tokenizer.get_vocab())
    target_model, draft_model = build(vocab_size), build(vocab_size)  # the same seed: one model
    nn.quantize(draft_model, group_size=32, bits=bits)
    mx.eval(draft_model.parameters())
    return Pair(name, target_model, draft_model, tokenizer,
                f"{note}; its {bits}-bit copy as the draft", held_out=True)


def _hybrid_f32() -> Pair:
    return _random_pair("hybrid-f32", _random_hybrid, HYBRID_DRAFT_BITS,
                        "a random Gated-DeltaNet hybrid target (qwen3_5 class, "
                        f"{RANDOM_TARGET['layers']} layers, 1 in 3 full attention), float32")


def _sliding_f32() -> Pair:
    return _random_pair("sliding-f32", _random_sliding, SLIDING_DRAFT_BITS,
                        "a random sliding-window target (gemma3_text class, "
                        f"{RANDOM_TARGET['layers']} layers, window {RANDOM_TARGET['window']}), "
                        "float32")


def _random_early_exit(name: str, build, layers: int, note: str) -> Pair:
    """A random target (`build`) drafting with its own first `layers` layers, norm and head."""
    _, _, tokenizer = _shipped()
    vocab_size = len(tokenizer.get_vocab())
    target_model = build(vocab_size)
    draft_model = shallow_copy(target_model, build(vocab_size, layers), layers)
    return Pair(name, target_model, draft_model, tokenizer, note, held_out=True)


def _hybrid_skip_f32() -> Pair:
    return _random_early_exit(
        "hybrid-skip-f32", _random_hybrid, HYBRID_SKIP_LAYERS,
        f"the random hybrid target of hybrid-f32; its first {HYBRID_SKIP_LAYERS} layers "
        "(two recurrent, one attention), norm and head as the draft")


def _sliding_skip_f32() -> Pair:
    return _random_early_exit(
        "sliding-skip-f32", _random_sliding, SLIDING_SKIP_LAYERS,
        f"the random sliding-window target of sliding-f32; its first {SLIDING_SKIP_LAYERS} "
        "layers (two sliding-window, one global), norm and head as the draft")


def _mtp_f32() -> Pair:
    target_model, _, tokenizer = _shipped()
    _as_f32(target_model)
    return Pair("mtp-f32", target_model, "mtp", tokenizer,
                "the shipped target in float32 with its shipped MTP head (draft_model=\"mtp\")",
                held_out=True)


BUILDERS: Dict[str, Callable[[], Pair]] = {
    "shipped-f16": _shipped_f16,
    "shipped-f32": _shipped_f32,
    "weak": _weak,
    "strong": _strong,
    "noisy-f32": _noisy_f32,
    "skip-f32": _skip_f32,
    "noisy-f16": _noisy_f16,
    "hybrid-f32": _hybrid_f32,
    "sliding-f32": _sliding_f32,
    "mtp-f32": _mtp_f32,
    "skip-f16": _skip_f16,
    "hybrid-skip-f32": _hybrid_skip_f32,
    "sliding-skip-f32": _sliding_skip_f32,
}
ZOO_NAMES = tuple(BUILDERS)


def _dflash(name: str, float32: bool) -> Pair:
    target_model, _, tokenizer = _shipped()
    if float32:
        _as_f32(target_model)
    dtype = "float32" if float32 else "float16, as stored"
    return Pair(name, target_model, load_dflash(str(default_target_path().parent / "dflash")),
                tokenizer, f"the shipped target ({dtype}) with the shipped DFlash drafter")


EXTRA_BUILDERS: Dict[str, Callable[[], Pair]] = {
    "dflash-f16": lambda: _dflash("dflash-f16", False),
    "dflash-f32": lambda: _dflash("dflash-f32", True),
}
PAIR_NAMES = ZOO_NAMES + tuple(EXTRA_BUILDERS)  # what studies may name
TUNED_NAMES = ("shipped-f16", "shipped-f32", "weak", "strong", "noisy-f32")
HELD_OUT_NAMES = tuple(name for name in ZOO_NAMES if name not in TUNED_NAMES)


def build_zoo(names: Optional[Sequence[str]] = None) -> List[Pair]:
    """The named pairs (all of them by default), in the order asked."""
    names = list(ZOO_NAMES if names is None else names)
    builders = {**BUILDERS, **EXTRA_BUILDERS}
    unknown = [name for name in names if name not in builders]
    if unknown:
        raise ValueError(f"Unknown pair {unknown[0]!r}; choose from {', '.join(PAIR_NAMES)}.")
    return [builders[name]() for name in names]
