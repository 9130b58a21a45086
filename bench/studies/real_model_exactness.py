"""Is speculation exact on real models? Chi-square tests, rule by rule, on the GGUF files.

    python -m bench.studies.real_model_exactness --draws 20000 --out real-model-exactness
    python -m bench.studies.real_model_exactness --end-to-end 400 --cases lookup --out NAME

Rules that draft on the real models: prompt lookup's one-hot q on SmolLM2-135M-Instruct,
and SmolLM2 drafting for Gemma-3-270M across their tokenizers (the string rule's
one-hot q, the intersection rule's restricted q).
- Rule level (--draws): p is the target's real next-token distribution at T = 1 after a
  prompt, q the real draft's proposal there (lookup's token after the earlier match; the
  first target token of SmolLM2's greedy text; SmolLM2's distribution restricted to the
  shared tokens, mapped to Gemma ids); the acceptance rule the batch engine runs
  (acceptance.keyed_rule: the loop's rule with a key of its own; one draft) emits a token
  DRAWS times, compared with p over its 30 likeliest tokens and the pooled tail.
- End to end (--end-to-end N): `mlx-spec check`'s test (mlx_spec/exactness.py): the first
  two generated tokens sampled N times with speculation through the whole loop against
  the exact distribution. Costly here (each sample re-runs the prompt on the CPU).
Each beside the negative control (a rejection resampled from p instead of the residual),
which must fail. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import constants, study_header, write_results

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"
LOOKUP_PROMPT = "Repeat: the cat sat on the mat. the cat sat on the"
CROSS_PROMPT = "The capital of France is"
CASES = ("lookup", "cross-string", "cross-intersection")


TOP = 30  # likeliest tokens resolved; the rest pooled
CHUNK = 250  # draws evaluated at once


def _models(case, root, options):
    from mlx_spec import load

    if case == "lookup":
        target, tokenizer = load(str(root / SMOLLM2), **options)
        return target, tokenizer, None, None, LOOKUP_PROMPT
    target, tokenizer = load(str(root / GEMMA3), **options)
    draft, draft_tokenizer = load(str(root / SMOLLM2), **options)
    return target, tokenizer, draft, draft_tokenizer, CROSS_PROMPT


def _next_probs(model, ids):
    import mlx.core as mx

    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return mx.softmax(logits)  # T = 1


def real_q(case, target_tokenizer, draft, draft_tokenizer, ids, vocab):
    """The draft's q over the target vocabulary at the prompt's end, as the drafter builds it."""
    import mlx.core as mx
    import numpy as np

    from mlx_spec.drafters.vocab_bridge import make_bridge

    if case == "lookup":  # the token after the prompt's earlier occurrence of its last token
        earlier = max(i for i in range(len(ids) - 1) if ids[i] == ids[-1])
        return mx.array(np.eye(1, vocab, ids[earlier + 1], dtype=np.float32)[0])
    draft_ids = draft_tokenizer.encode(draft_tokenizer.decode(draft_tokenizer.encode(CROSS_PROMPT)))
    draft_p = np.array(_next_probs(draft, draft_ids))
    if case == "cross-string":  # the draft's greedy word, read by the target's tokenizer
        word = draft_tokenizer.decode([int(draft_p.argmax())])
        token = target_tokenizer.encode(CROSS_PROMPT + word)[len(ids)]
        return mx.array(np.eye(1, vocab, token, dtype=np.float32)[0])
    twins = make_bridge(target_tokenizer, draft_tokenizer).draft_to_target[:len(draft_p)]
    shared = (twins >= 0) & (twins < vocab)
    q = np.zeros(vocab, np.float32)
    q[twins[shared]] = draft_p[shared]
    return mx.array(q / q.sum())


def rule_level(case, root, draws, seed):
    """The acceptance rule on real p and q, DRAWS emitted tokens, chi-square on p's top tokens."""
    import mlx.core as mx
    import numpy as np

    from mlx_spec.acceptance import keyed_rule
    from mlx_spec.exactness import chi2_survival

    target, tokenizer, draft, draft_tokenizer, prompt = _models(case, root, {})
    ids = tokenizer.encode(prompt)
    p = _next_probs(target, ids)
    vocab = p.shape[-1]
    q = real_q(case, tokenizer, draft, draft_tokenizer, ids, vocab)
    logp = mx.log(mx.stack([p, p]))  # (k + 1, V): the bonus row is never reached when rejected
    p_np = np.array(p, dtype=np.float64)
    top = np.argsort(-p_np)[:TOP]
    rows = []
    # the batch engine's rule (a key of its own per draw), many draws at once
    for label, residual in (("exact rule", True), ("negative control", False)):
        rule = mx.vmap(keyed_rule(residual), in_axes=(0, None, None, 0))
        started = time.perf_counter()
        emitted = []
        for chunk in range(0, draws, CHUNK):
            n_draws = min(CHUNK, draws - chunk)
            key = mx.random.key(seed * 1_000_003 + chunk + (0 if residual else 500_000_000))
            x_key, rule_key = mx.random.split(key)
            x = mx.random.categorical(mx.log(q), num_samples=n_draws, key=x_key)
            x = x.astype(mx.uint32)[:, None]  # (n, k = 1)
            n, nxt = rule(x, q[None], logp, mx.random.split(rule_key, n_draws))
            emitted.append(np.array(mx.where(n > 0, x[:, 0], nxt)))
        tokens = np.concatenate(emitted)
        counts = np.array([np.sum(tokens == t) for t in top] + [np.sum(~np.isin(tokens, top))])
        expected = draws * np.append(p_np[top], 1 - p_np[top].sum())
        keep = expected >= 5
        pooled_c = np.append(counts[keep], counts[~keep].sum())
        pooled_e = np.append(expected[keep], expected[~keep].sum())
        if pooled_e[-1] < 5:
            pooled_c, pooled_e = pooled_c[:-1], pooled_e[:-1]
        statistic = float(((pooled_c - pooled_e) ** 2 / pooled_e).sum())
        dof = len(pooled_c) - 1
        p_value = chi2_survival(statistic, dof)
        q_np = np.array(q, dtype=np.float64)
        rows.append({"case": case, "level": "rule", "rule": label, "prompt": prompt,
                     "samples": draws, "chi2": round(statistic, 2), "dof": dof,
                     "p_value": p_value, "passed": p_value > 1e-3,
                     "acceptance": round(float(np.minimum(p_np, q_np).sum()), 3),
                     "p_top_mass": round(float(p_np[top].sum()), 3),
                     "seconds": round(time.perf_counter() - started, 1)})
    return rows


def run_case(case, root, samples, dequantize, seed):
    """`mlx-spec check`'s end-to-end test through the whole loop, SAMPLES times."""
    from mlx_spec.acceptance import resample_from_target_accept
    from mlx_spec.drafters import cross_tokenizer
    from mlx_spec.exactness import check_exactness
    from mlx_spec.sampling import SamplingConfig

    options = {"dequantize": True, "dtype": "float32"} if dequantize else {}
    sampling = SamplingConfig(temp=1.0)
    target, tokenizer, draft, draft_tokenizer, prompt = _models(case, root, options)
    rule = None if case == "lookup" else case.split("-", 1)[1]
    ids = tokenizer.encode(prompt)
    rows = []
    for label, accept in (("exact rule", None), ("negative control", resample_from_target_accept)):
        started = time.perf_counter()
        with constants(cross_tokenizer, DEFAULT_RULE=rule or cross_tokenizer.DEFAULT_RULE):
            result = check_exactness(target, draft, ids, sampling, samples=samples,
                                     num_draft_tokens=2, accept=accept,
                                     prompt_lookup=(case == "lookup"), seed=seed,
                                     draft_tokenizer=draft_tokenizer, target_tokenizer=tokenizer)
        rows.append({"case": case, "level": "end to end", "rule": label, "prompt": prompt,
                     "samples": samples,
                     "chi2": round(result.statistic, 2), "dof": result.dof,
                     "p_value": result.p_value, "passed": result.passed,
                     "drafted": result.drafted, "acceptance": round(result.acceptance_rate, 3),
                     "seconds": round(time.perf_counter() - started, 1)})
    return rows


def markdown(header, rows) -> str:
    lines = ["# Exactness on the real models (chi-square at T = 1)\n",
             f"Command: `{header['command']}`  ", f"Machine: {header['machine']}\n",
             "| case | level | rule | samples | chi2 | dof | p | verdict | acceptance | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "indistinguishable" if r["passed"] else "differs"
        lines.append(f"| {r['case']} | {r['level']} | {r['rule']} | {r['samples']} | {r['chi2']} | "
                     f"{r['dof']} | {r['p_value']:.3g} | {verdict} | {r['acceptance']} | "
                     f"{r['seconds']} |")
    lines.append(f"\nRule level: p over its {TOP} likeliest tokens and the pooled tail (cells "
                 "with fewer than 5 expected pooled); acceptance = sum min(p, q), the chance a "
                 "draft is kept. The exact rule must read indistinguishable (p > 0.001) and the "
                 "negative control differ.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--draws", type=int, default=20000, help="rule-level draws per rule")
    parser.add_argument("--end-to-end", type=int, default=0,
                        help="also run mlx-spec check's test through the loop, this many samples")
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="real-model-exactness")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}.")
    if args.draws < 1000:
        parser.error("--draws must be at least 1000.")
    if 0 < args.end_to_end < 100:
        parser.error("--end-to-end must be 0 (off) or at least 100.")
    root = Path(os.environ.get("MLX_SPEC_REAL_MODELS") or "~/.cache/mlx-spec/real-models").expanduser()
    for name in (SMOLLM2, GEMMA3):
        if not (root / name).is_file():
            parser.error(f"{name} is not in {root}; run `make real-models` first.")
    header = study_header("real_model_exactness", argv)
    rows = []
    for case in cases:
        rows += rule_level(case, root, args.draws, args.seed)
        if args.end_to_end:
            rows += run_case(case, root, args.end_to_end, args.dequantize, args.seed)
    write_results(args.out, header, rows, markdown(header, rows))


if __name__ == "__main__":
    sys.exit(main())
