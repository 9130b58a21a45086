"""What rewinding costs: a verify round with rejections, per cache kind and rewind path.

    python -m bench.studies.rewind_cost [--hidden 512 --layers 8 --context 256]

Random models of equal size (hidden, layers, vocabulary): a Gated DeltaNet
hybrid (mlx-lm's qwen3_5 class, 3 of every 4 layers linear attention) and a
plain llama. One round = anchor, a verify forward over k + 1 = 5 tokens, the
host sync, keep 2 of them, then evaluate the caches (a replay is lazy, so its
cost lands here). Rewind paths: the Gated DeltaNet recurrence alone (the
default), the recurrent mixers, the whole model. Interleaved medians after a
warm-up; each round starts from the same prefilled context. Prints a table
and one JSON line; writes no file.
"""

import argparse
import json

import mlx.core as mx
from mlx_lm.models import llama, qwen3_5

from mlx_spec.bench.machine import blas_library
from mlx_spec.bench.timing import interleaved_medians
from mlx_spec.cache import ModelCache, describe_kinds, make_cache

VOCAB = 4096
FED = 5  # k + 1 with k = 4
KEPT = 2


def hybrid(hidden, layers):
    head = 64
    args = qwen3_5.ModelArgs.from_dict({
        "model_type": "qwen3_5", "hidden_size": hidden, "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers, "full_attention_interval": 4,
        "num_attention_heads": hidden // head, "num_key_value_heads": 2, "head_dim": head,
        "linear_num_value_heads": hidden // head, "linear_num_key_heads": hidden // (2 * head),
        "linear_key_head_dim": head, "linear_value_head_dim": head, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    })
    return qwen3_5.Model(args)


def plain(hidden, layers):
    return llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=3 * hidden, num_attention_heads=hidden // 64, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=False))


def prepared(model, context):
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    cache = ModelCache(model, make_cache(model))
    cache.forward(mx.random.randint(0, VOCAB, (context,)).astype(mx.uint32))
    mx.eval([c.state for c in cache.layers])
    return cache, cache.checkpoint()


def round_fn(cache, base, keep, path="auto", bookkeeping=True):
    tokens = mx.random.randint(0, VOCAB, (FED,)).astype(mx.uint32)
    mx.eval(tokens)
    host = tokens.tolist()

    def run():
        cache.restore(base)
        if bookkeeping:
            cache.anchor()
        logits = cache.forward(tokens)
        mx.eval(logits)  # the round's sync
        if bookkeeping:
            cache.fed(host)
            if path == "model":
                cache.mixers.calls.clear()  # as if the mixers could not be recorded
            if path == "mixers":
                cache.mixers.recurrences.clear()  # as if the recurrence could not be recorded
            cache.keep(keep)
        mx.eval([c.state for c in cache.layers])

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    mx.random.seed(0)
    h_cache, h_base = prepared(hybrid(args.hidden, args.layers), args.context)
    p_cache, p_base = prepared(plain(args.hidden, args.layers), args.context)
    fns = {
        "plain: no bookkeeping": round_fn(p_cache, p_base, FED, bookkeeping=False),
        "plain: keep 2 of 5 (trim)": round_fn(p_cache, p_base, KEPT),
        "hybrid: no bookkeeping": round_fn(h_cache, h_base, FED, bookkeeping=False),
        "hybrid: keep 5 of 5 (full accept)": round_fn(h_cache, h_base, FED),
        "hybrid: keep 2 of 5, recurrence replay": round_fn(h_cache, h_base, KEPT),
        "hybrid: keep 2 of 5, mixers replay": round_fn(h_cache, h_base, KEPT, "mixers"),
        "hybrid: keep 2 of 5, whole-model replay": round_fn(h_cache, h_base, KEPT, "model"),
    }
    medians = interleaved_medians(fns, repeats=args.repeats, warmup=2)
    base = medians["hybrid: no bookkeeping"]
    print(f"BLAS: {blas_library()}; device: {mx.default_device()}; float16; "
          f"hidden {args.hidden}, {args.layers} layers, context {args.context}")
    print(f"hybrid cache: {describe_kinds(h_cache.layers)}; plain cache: {describe_kinds(p_cache.layers)}")
    for name, seconds in medians.items():
        print(f"{name:42s} {seconds * 1e3:7.2f} ms  {seconds / base:5.2f}x hybrid round")
    ratio = medians["hybrid: keep 2 of 5, recurrence replay"] / medians["plain: keep 2 of 5 (trim)"]
    print(f"hybrid / plain round with rejections: {ratio:.2f}x")
    print(json.dumps({k: round(v * 1e3, 3) for k, v in medians.items()}))


if __name__ == "__main__":
    main()
