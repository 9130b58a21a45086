"""The automatic off switch with a useless draft: plain vs adaptive vs fixed k = 4.

    python -m bench.studies.off_switch

The shipped target drafts with a random one-layer llama (same vocabulary, no
skill): every draft is rejected, so speculation can only lose. Interleaved
runs of 200 tokens, prefill excluded, medians after a warm-up; the goal is
adaptive within 5% of plain decoding. Prints a table; writes no file.
"""

import statistics

import mlx.core as mx
from mlx_lm.models import llama

from mlx_spec import load
from mlx_spec.bench.timing import time_after_prefill
from mlx_spec.generate import speculative_generate_step

REPEATS = 5


def useless_draft(vocab_size: int):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-5,
                           vocab_size=vocab_size, tie_word_embeddings=False)
    mx.random.seed(3)
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model


def tokens_per_second(ids, target_model, **options) -> float:
    decoded = time_after_prefill(speculative_generate_step(ids, target_model, max_tokens=200,
                                                           **options))
    return decoded.tokens / decoded.seconds


if __name__ == "__main__":
    target_model, tokenizer = load()
    draft_model = useless_draft(target_model.args.vocab_size)
    ids = tokenizer.encode("def parse_args(argv=None):\n    parser = argparse.ArgumentParser()\n")
    methods = {"plain": {"prompt_lookup": False},
               "adaptive": {"draft_model": draft_model, "adaptive": True, "prompt_lookup": False},
               "fixed k=4": {"draft_model": draft_model, "num_draft_tokens": 4, "prompt_lookup": False}}
    rates = {name: [] for name in methods}
    for repeat in range(REPEATS + 1):
        for name, options in methods.items():
            rates[name].append(tokens_per_second(ids, target_model, **options))
    medians = {name: statistics.median(r[1:]) for name, r in rates.items()}
    for name, value in medians.items():
        print(f"{name:10s} {value:6.1f} tokens/s  {value / medians['plain']:.2f}x plain")
