"""Does mlx-spec read a real GGUF file as it was meant? Perplexity, greedy text and tokens.

    python -m bench.studies.gguf_fidelity --out gguf-fidelity
    python -m bench.studies.gguf_fidelity --llama-cpp /path/to/venv/bin/python --out NAME

For each real model (SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M; see
`make real-models`), three readings of the same file:
- mlx-spec: `mlx_spec.load(path)` (its defaults: exact repacks, re-quantized K-quants);
- dequantized: `mlx_spec.load(path, dequantize=True, dtype="float32")`, every matrix
  dequantized by the `gguf` package (llama.cpp's own Python reference), computed in float32;
- llama.cpp (with --llama-cpp PYTHON, a Python with llama-cpp-python installed): the
  file run by llama.cpp itself, an implementation independent of this repository.
Reported: perplexity on a held-out passage (the same token ids for every reading),
mean KL from the dequantized reading, greedy continuations of a few prompts (equal
token for token?), and, with llama.cpp, tokenization of a text corpus compared id for
id and llama.cpp's perplexity and greedy tokens. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import study_header, write_results

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}

# Held out: written for this study, seen by no one's training or tuning here.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. At the top he "
    "trimmed the wick, polished the great lens, and wrote the weather in a leather book: the "
    "direction of the wind, the height of the swell, the ships that passed. In forty years he "
    "had missed only two nights, once for his daughter's wedding and once when a storm tore the "
    "door from its hinges. When the lamp was finally replaced by an automatic light, the "
    "engineers found his books stacked in a cupboard, more than fourteen thousand pages of small, "
    "careful handwriting. A historian later used them to reconstruct the storms of the century, "
    "and discovered that the keeper had recorded a change in the winter winds long before anyone "
    "else had noticed it."
)
PROMPTS = [
    "The three primary colors are",
    "def is_prime(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]


def _corpus(seed: int = 0, count: int = 300) -> list:
    """Texts for tokenization: fixed cases and seeded random mixes of scripts, spaces and digits."""
    fixed = ["Hello world", " leading space", "  two  spaces  ", "line\nbreak\n\n", "tab\tx",
             "naïve café déjà vu", "日本語のテキスト", "emoji 🤖🦤 👩‍👩‍👧", "Привет, мир!",
             "def f(x):\n    return x ** 2\n", "1234567890 3.14159 1e-10", "$1,234.56",
             "<|im_start|>user\nHi<|im_end|>", "<start_of_turn>user\nHi<end_of_turn>", ""]
    rng = random.Random(seed)
    pools = ["abcdefghijklmnopqrstuvwxyz ", "ABCXYZ 0123456789.,;:!?'\"()[]{}<>-_=+*/", " \t\n",
             "éèêàâäöüçñßøåæ", "日本語中文한국어", "🤖🦤👍🏽", "привет"]
    texts = list(fixed)
    while len(texts) < count:
        alphabet = "".join(rng.sample(pools, rng.randint(1, 3)))
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    return texts


def _perplexity_and_logprobs(model, ids):
    import mlx.core as mx

    logits = model(mx.array([ids])).astype(mx.float32)[0, :-1]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(ids[1:])
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1).mean().item()
    return math.exp(nll), logprobs


def _greedy(model, ids, tokens, gaps=None):
    """mlx-lm's greedy decoding; `gaps` (a list) receives the top-two log-probability gap
    of each step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, logprobs in generate_step(mx.array(ids), model, max_tokens=tokens):
        out.append(int(token))
        if gaps is not None:
            top = mx.sort(logprobs)[-2:].tolist()
            gaps.append(round(top[1] - top[0], 3))
    return out


_LLAMA_CPP = r"""
import json, sys, math
import numpy as np
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["path"], n_ctx=1024, logits_all=True, verbose=False, n_threads=2)
tok = [llm.tokenize(t.encode(), add_bos=True, special=True) for t in job["corpus"]]
ids = job["passage_ids"]
llm.reset(); llm.eval(ids)
scores = np.array(llm.scores[:len(ids)], dtype=np.float64)
lp = scores - np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True)) - scores.max(-1, keepdims=True)
nll = -np.mean([lp[i, ids[i + 1]] for i in range(len(ids) - 1)])
greedy = []
for p in job["prompt_ids"]:
    llm.reset(); llm.eval(p); out = []
    for _ in range(job["tokens"]):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1])); out.append(t); llm.eval([t])
    greedy.append(out)
json.dump({"tokenized": tok, "ppl": math.exp(nll), "greedy": greedy}, open(sys.argv[2], "w"))
"""


def _first_difference(a, b):
    """Index of the first token where two continuations part, or None if they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _llama_cpp(python, path, corpus, passage_ids, prompt_ids, tokens):
    with tempfile.TemporaryDirectory() as folder:
        job, out, script = (Path(folder) / name for name in ("job.json", "out.json", "run.py"))
        job.write_text(json.dumps({"path": str(path), "corpus": corpus, "passage_ids": passage_ids,
                                   "prompt_ids": prompt_ids, "tokens": tokens}))
        script.write_text(_LLAMA_CPP)
        subprocess.run([python, str(script), str(job), str(out)], check=True)
        return json.loads(out.read_text())


def measure(name, path, tokens, llama_cpp=None) -> dict:
    import mlx.core as mx

    from mlx_spec import load
    from mlx_spec.loading import gguf_report

    started = time.perf_counter()
    model, tokenizer = load(str(path))
    load_seconds = time.perf_counter() - started
    reference, _ = load(str(path), dequantize=True, dtype="float32")
    ids = tokenizer.encode(PASSAGE)
    if ids[:1] != [tokenizer.bos_token_id] and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids  # llama.cpp scores a passage after BOS
    ppl, logprobs = _perplexity_and_logprobs(model, ids)
    ref_ppl, ref_logprobs = _perplexity_and_logprobs(reference, ids)
    kl = (mx.exp(ref_logprobs) * (ref_logprobs - logprobs)).sum(-1).mean().item()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    gaps = [[] for _ in prompt_ids]
    ours = [_greedy(model, p, tokens, g) for p, g in zip(prompt_ids, gaps)]
    theirs = [_greedy(reference, p, tokens) for p in prompt_ids]
    row = {
        "model": name, "file": path.name, "conversion": gguf_report(model).summary(),
        "load_seconds": round(load_seconds, 2), "passage_tokens": len(ids),
        "ppl": round(ppl, 4), "ppl_dequantized": round(ref_ppl, 4),
        "ppl_ratio": round(ppl / ref_ppl, 5), "kl_from_dequantized": kl,
        "greedy_equal_dequantized": sum(a == b for a, b in zip(ours, theirs)),
        "greedy_prompts": len(PROMPTS),
        "greedy_text": [tokenizer.decode(o) for o in ours],
    }
    if llama_cpp:
        corpus = _corpus()
        reply = _llama_cpp(llama_cpp, path, corpus, ids, prompt_ids, tokens)
        mismatches = [text for text, want in zip(corpus, reply["tokenized"])
                      if tokenizer.encode(text) != want]
        row.update({
            "corpus_texts": len(corpus), "tokenization_mismatches": len(mismatches),
            "mismatched_examples": mismatches[:5], "ppl_llama_cpp": round(reply["ppl"], 4),
            "ppl_ratio_llama_cpp": round(ppl / reply["ppl"], 5),
            "greedy_equal_llama_cpp": sum(a == b for a, b in zip(ours, reply["greedy"])),
            "greedy_first_difference_llama_cpp": [_first_difference(a, b)
                                                  for a, b in zip(ours, reply["greedy"])],
            "top_two_gap_there": [None if i is None else g[i] for i, g in zip(
                (_first_difference(a, b) for a, b in zip(ours, reply["greedy"])), gaps)],
        })
    return row


def markdown(header, rows) -> str:
    lines = [f"# GGUF fidelity\n", f"Command: `{header['command']}`  ", f"Machine: {header['machine']}\n",
             "| model | load s | ppl mlx-spec | ppl dequantized | ratio | KL (nats) | greedy = dequantized |"
             " ppl llama.cpp | ratio | greedy = llama.cpp | tokenization mismatches |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpp = (f"{r['ppl_llama_cpp']} | {r['ppl_ratio_llama_cpp']} | "
               f"{r['greedy_equal_llama_cpp']}/{r['greedy_prompts']} | "
               f"{r['tokenization_mismatches']}/{r['corpus_texts']}") if "ppl_llama_cpp" in r \
            else "- | - | - | -"
        lines.append(f"| {r['model']} | {r['load_seconds']} | {r['ppl']} | {r['ppl_dequantized']} | "
                     f"{r['ppl_ratio']} | {r['kl_from_dequantized']:.2e} | "
                     f"{r['greedy_equal_dequantized']}/{r['greedy_prompts']} | {cpp} |")
    lines.append("")
    if any("greedy_first_difference_llama_cpp" in r for r in rows):
        lines.append("First token where llama.cpp's greedy continuation differs (None: equal), and "
                     "mlx-spec's gap between its top two log-probabilities there: "
                     + "; ".join(f"{r['model']} {r['greedy_first_difference_llama_cpp']} "
                                 f"(gaps {r['top_two_gap_there']})"
                                 for r in rows if "greedy_first_difference_llama_cpp" in r) + "\n")
    for r in rows:
        lines.append(f"- {r['conversion']}")
        for prompt, text in zip(PROMPTS, r["greedy_text"]):
            lines.append(f"  - `{prompt}` -> `{text!r}`")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    parser.add_argument("--llama-cpp", default=None,
                        help="a Python executable with llama-cpp-python installed (optional)")
    parser.add_argument("--out", default="gguf-fidelity")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}.")
    if args.tokens < 1:
        parser.error("--tokens must be at least 1.")
    root = Path(os.environ.get("MLX_SPEC_REAL_MODELS") or "~/.cache/mlx-spec/real-models").expanduser()
    missing = [MODELS[n] for n in names if not (root / MODELS[n]).is_file()]
    if missing:
        parser.error(f"{missing[0]} is not in {root}; run `make real-models` first.")
    header = study_header("gguf_fidelity", argv)
    rows = [measure(n, root / MODELS[n], args.tokens, args.llama_cpp) for n in names]
    write_results(args.out, header, rows, markdown(header, rows))


if __name__ == "__main__":
    sys.exit(main())
