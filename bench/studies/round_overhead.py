"""Per-round overhead at equal work: mlx-lm's speculative loop against mlx-spec's.

Greedy, fixed k, no prompt lookup, so both accept exactly the same drafts.
Two pairs: a tiny one whose device work is next to nothing (one target, and
the same weights as the draft, so every draft is accepted: the round cost is
all overhead), and the shipped pair. For each method, interleaved in every
repeat: wall milliseconds per token and the main thread's CPU milliseconds
per round (`time.thread_time`: Python bookkeeping and graph building; MLX's
CPU kernels run on their own threads). "mlx-spec, device rule" judges greedy
drafts with the acceptance rule's graph, as every round did before the host
comparison; "mlx-spec" is the current loop.

    python -m bench.studies.round_overhead [--repeats 15] [--max-tokens 200]

Prints its figures; writes no file.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama

from mlx_spec.acceptance import greedy_accept
from mlx_spec.bench.endtoend import run_mlx_lm, run_mlx_spec
from mlx_spec.bench.machine import machine_info
from mlx_spec.bench.prompts import PROMPTS, encode_prompts
from mlx_spec.loading import default_draft_path, default_target_path, load


def tiny_model(seed: int, hidden: int = 16, layers: int = 2):
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=2 * hidden, num_attention_heads=2,
                           num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=1024,
                           tie_word_embeddings=False)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def device_rule(*args):  # the same rule, not recognised as greedy: judged by its graph
    return greedy_accept(*args)


def measure(target_model, draft_model, ids, k, max_tokens, repeats):
    methods = {
        "mlx-lm": lambda: run_mlx_lm(target_model, draft_model, ids, 0.0, k, max_tokens),
        "mlx-spec, device rule": lambda: run_mlx_spec(target_model, draft_model, ids, 0.0, k,
                                                      max_tokens, accept=device_rule),
        "mlx-spec": lambda: run_mlx_spec(target_model, draft_model, ids, 0.0, k, max_tokens),
    }
    wall = {name: [] for name in methods}
    host = {name: [] for name in methods}
    for r in range(repeats + 1):
        for name, run in methods.items():
            cpu = time.thread_time()
            result = run()
            cpu = time.thread_time() - cpu
            rounds = max(result.drafted // k, 1)
            if r:  # the first repeat warms up
                wall[name].append(result.seconds / result.tokens * 1e3)
                host[name].append(cpu / rounds * 1e3)
    base = statistics.median(wall["mlx-lm"])
    for name in methods:
        w, h = statistics.median(wall[name]), statistics.median(host[name])
        print(f"  {name:22s} {w:7.3f} ms/token ({base / w:.3f}x mlx-lm's speed), "
              f"host CPU {h:6.3f} ms/round")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("-k", type=int, default=4)
    args = parser.parse_args()
    machine = machine_info()
    print(f"machine: {machine}")
    print(f"tiny pair (hidden 16, 2 layers, draft = target), k = {args.k}:")
    tiny = tiny_model(1)
    measure(tiny, tiny_model(1), list(range(1, 40)), args.k, args.max_tokens, args.repeats)
    target_model, tokenizer = load(str(default_target_path()))
    draft_model, _ = load(str(default_draft_path()))
    ids = encode_prompts(tokenizer, PROMPTS[1:2])[0][1]
    print(f"shipped pair (float16), prompt class_init, k = {args.k}:")
    measure(target_model, draft_model, ids, args.k, args.max_tokens // 2, max(args.repeats // 3, 3))


if __name__ == "__main__":
    main()
