"""The cost of a DFlash block: the target's verify pass over 16 tokens against 1, the drafter's
block pass against one target step, on this machine; and what the cost model then predicts
for Apple M-series chips (a roofline MODEL, not a measurement).

    python -m bench.studies.dflash_cost --out dflash-cost-netlib
    OPENBLAS_NUM_THREADS=1 \
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python -m bench.studies.dflash_cost --out dflash-cost-openblas
    [--row-agreement 0.6 | 0.8,0.7,0.6,...] [--dflash DIR] [--context 256] [--repeats 21]

Measured here, for float16 and float32 (the target and the drafter in the same dtype),
interleaved, medians over `--repeats` after one warm-up:

1. the shipped target's forward over T = 1, 2, 4, 8, 16 tokens after a `--context`-token
   prefix (mlx_spec.bench.forward), relative to T = 1: verify_cost(T);
2. one DFlash drafter pass, relative to one target forward over 1 token: `block` is the
   proposal alone (the block of `--block` rows through the drafter's layers, then the target's
   output head over the k rows read), `round` adds the catch-up a round pays first (the k + 1
   rows a fully accepted round hands over: fc and each layer's keys/values). The drafter is
   the shipped one (mlx_spec/default_models/dflash) when it exists, else z-lab's layout for
   the shipped target with random weights (training/dflash.py's defaults: taps 1,3,4, 2
   layers, block 16; the cost depends on shapes only). `--dflash DIR` names another.
3. the cost model: with `--row-agreement` p_1, p_2, ... (p_i: the chance that draft i is
   accepted once drafts 1..i-1 were; one value = the same for every row, i.e. geometric; a
   shorter list is extended with its last value), E[tokens per round] = 1 + sum_j prod_{i<=j}
   p_i, and for k = 3, 7, 15 drafts (blocks of 4, 8, 16)
   speed-up(k) = E[tokens per round] / (draft_cost + verify_cost(k + 1)),
   draft_cost the measured `round` cost (one drafter pass drafts all k).

4. MODEL, NOT MEASURED: a roofline for Apple M-series GPUs. Target: Qwen3-8B at 4-bit
   (hidden 4096, 36 layers, 32/8 heads of 128, MLP 12288, vocabulary 151936, untied head;
   MLX 4-bit with group 64 = 4.5 bits a weight: 8.19 B parameters, ~4.6 GB of weights; one
   pass reads the layers and the head, ~4.26 GB, plus the KV cache at `--mac-context` tokens,
   147 KB a token). Drafter: 5 DFlash layers of the target's width (192.9 M parameters each)
   and fc from 5 taps (83.9 M): 1.05 B parameters, 2.10 GB in bfloat16 as z-lab publishes
   them (0.59 GB at 4-bit, the second variant), plus the target's 4-bit head (0.35 GB) read
   for the k drafted rows. A pass of P weights over T tokens takes
   max(bytes / bandwidth, 2 * P * T / flops) (attention's own flops left out: < 5 % at 1024
   tokens of context); verify_cost(T) = time(T) / time(1), draft_cost = the drafter's pass
   over its block of 16 rows (plus k + 1 context rows and the head over k rows) / time(1).
   Per chip (bandwidth; GPU FP16 TFLOPS, the same rate as FP32 on these GPUs):
     M1 (8-core GPU):      68.25 GB/s, 2.6 TFLOPS. TFLOPS: Apple's published spec (M1 press
                           release, Nov 2020). Bandwidth: NOT stated by Apple for M1; LPDDR4X-4266
                           on a 128-bit bus (Apple states M2's 100 GB/s is 50 % more than M1's).
     M2 Pro (19-core GPU): 200 GB/s: Apple's published spec (Jan 2023). 6.8 TFLOPS: NOT
                           published by Apple; a third-party estimate (19 cores x 128 ALUs x 2
                           x 1.398 GHz).
     M3 Max (40-core GPU): 400 GB/s: Apple's published spec (Oct 2023; 300 GB/s for the
                           30-core). 14.3 TFLOPS: NOT published by Apple; third-party estimate
                           (40 x 128 x 2 x 1.398 GHz; other listings give 16.4 at 1.6 GHz).
     M4 Max (40-core GPU): 546 GB/s: Apple's published spec (Oct 2024). 17.2 TFLOPS: NOT
                           published by Apple; third-party estimate (40 x 128 x 2 x 1.678 GHz).
   Peak figures: real kernels reach a fraction of both (`--mac-bandwidth-efficiency`,
   `--mac-compute-efficiency`, default 1). The prediction is as good as those.

Writes bench/results/<NAME>.json and .md (default `dflash-cost`). Run from the repository
root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from functools import reduce

import mlx.core as mx

from mlx_spec import load
from mlx_spec.bench.block_drafter import drafter_passes
from mlx_spec.bench.forward import forward_seconds, prefilled_cache
from mlx_spec.bench.machine import blas_library
from mlx_spec.bench.timing import interleaved_medians
from mlx_spec.costmodel import block_round_cost, expected_tokens_per_round, interpolate
from mlx_spec.dflash import DFlashModel, load_dflash, parse_config
from mlx_spec.loading import default_target_path
from mlx_spec.memory import model_bytes
from . import RESULTS_DIR

LENGTHS = (1, 2, 4, 8, 16)
KS = (3, 7, 15)
DTYPES = {"float16": mx.float16, "float32": mx.float32}

# --- the M-series model (see the docstring for where every figure comes from) ---
CHIPS = (  # name, GB/s, FP16 TFLOPS, provenance
    ("M1 (8-core GPU)", 68.25, 2.6,
     "TFLOPS: Apple's published spec; bandwidth: LPDDR4X-4266 x 128 bit (not stated by Apple)"),
    ("M2 Pro (19-core GPU)", 200.0, 6.8,
     "bandwidth: Apple's published spec; TFLOPS: third-party estimate"),
    ("M3 Max (40-core GPU)", 400.0, 14.3,
     "bandwidth: Apple's published spec; TFLOPS: third-party estimate"),
    ("M4 Max (40-core GPU)", 546.0, 17.2,
     "bandwidth: Apple's published spec; TFLOPS: third-party estimate"),
)
QWEN3_8B = {"hidden": 4096, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "intermediate": 12288, "vocab": 151936}
MLX_4BIT = 4.5  # bits a weight: 4 + an fp16 scale and bias per group of 64
DRAFTER_LAYERS, DRAFTER_TAPS, DRAFTER_BLOCK = 5, 5, 16


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dflash", default=None,
                    help="a DFlash drafter's directory (default: the shipped one if present, "
                         "else random weights in z-lab's layout)")
    ap.add_argument("--layers", type=int, default=2, help="random drafter: its layers")
    ap.add_argument("--taps", default="1,3,4", help="random drafter: the target layers it reads")
    ap.add_argument("--block", type=int, default=16, help="random drafter: its block size")
    ap.add_argument("--context", type=int, default=256, help="prefix tokens before each pass")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--row-agreement", default="0.6",
                    help="p_1,p_2,...: per-row acceptance (one value: the same for every row)")
    ap.add_argument("--mac-context", type=int, default=1024,
                    help="model: tokens in the KV cache of the M-series passes")
    ap.add_argument("--mac-bandwidth-efficiency", type=float, default=1.0)
    ap.add_argument("--mac-compute-efficiency", type=float, default=1.0)
    ap.add_argument("--out", default="dflash-cost")
    return ap.parse_args()


def row_agreement(text: str, rows: int = max(KS)) -> list:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise SystemExit(f"--row-agreement needs probabilities in [0, 1]; got {text!r}")
    return (values + [values[-1]] * rows)[:max(rows, len(values))]


def tokens_per_round(rows: list, k: int) -> float:
    """E[tokens per round] with k drafts: 1 + sum_j prod_{i<=j} p_i (geometric: closed form)."""
    if len(set(rows[:k])) == 1:
        return expected_tokens_per_round(rows[0], k)
    return 1.0 + sum(reduce(lambda a, b: a * b, rows[:j], 1.0) for j in range(1, k + 1))


def block_speedup(rows: list, k: int, draft_cost: float, verify_cost: dict) -> float:
    return tokens_per_round(rows, k) / block_round_cost(draft_cost, k, verify_cost)


# --- measured on this machine ---

def drafter_for(target, args):
    """(drafter, where it came from)."""
    shipped = default_target_path().parent / "dflash"
    path = args.dflash or (shipped if (shipped / "config.json").exists() else None)
    if path is not None:
        return load_dflash(path), str(path)
    a = target.args  # z-lab's config.json for this target, as training/dflash.py writes it
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": args.layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": None,
        "vocab_size": a.vocab_size, "block_size": args.block,
        "dflash_config": {"mask_token_id": a.vocab_size - 1, "block_size": args.block,
                          "target_layer_ids": [int(t) for t in args.taps.split(",")]},
    }
    drafter = DFlashModel(parse_config(config, "the random drafter"))
    mx.eval(drafter.parameters())
    return drafter, (f"random weights, z-lab's layout: {args.layers} layers, taps {args.taps}, "
                     f"block {args.block}")


def measure(dtype, args):
    target, _ = load()
    target.set_dtype(dtype)
    drafter, source = drafter_for(target, args)
    drafter.set_dtype(dtype)
    cache = prefilled_cache(target, args.context)
    passes = drafter_passes(drafter, target, args.context, KS)
    target_times = {t: [] for t in LENGTHS}
    drafter_times = {key: [] for key in passes}
    for r in range(1 + args.repeats):  # target and drafter in turn within every repeat
        seconds = forward_seconds(target, cache, LENGTHS, repeats=1, warmup=0)
        drafted = interleaved_medians(passes, repeats=1, warmup=0)
        if r:  # the first is the warm-up
            for t in LENGTHS:
                target_times[t].append(seconds[t])
            for key in passes:
                drafter_times[key].append(drafted[key])
    step = {t: statistics.median(v) for t, v in target_times.items()}
    drafted = {key: statistics.median(v) for key, v in drafter_times.items()}
    config = drafter.dflash_config
    return {
        "drafter": source, "drafter_layers": config.num_hidden_layers,
        "drafter_block": config.block_size, "drafter_bytes": model_bytes(drafter),
        "target_bytes": model_bytes(target),
        "target_ms": {t: round(s * 1e3, 3) for t, s in step.items()},
        "verify_cost": {t: round(s / step[1], 3) for t, s in step.items()},
        "drafter_ms": {f"{kind} k={k}": round(s * 1e3, 3) for (kind, k), s in drafted.items()},
        "draft_cost": {f"{kind} k={k}": round(s / step[1], 3) for (kind, k), s in drafted.items()},
    }


def cost_model(measured: dict, rows: list) -> list:
    curve = measured["verify_cost"]
    out = []
    for k in KS:
        draft = measured["draft_cost"][f"round k={k}"]
        out.append({"k": k, "block": k + 1, "tokens_per_round": round(tokens_per_round(rows, k), 3),
                    "draft_cost": draft, "verify_cost": round(interpolate(curve, k + 1), 3),
                    "speedup": round(block_speedup(rows, k, draft, curve), 3)})
    return out


# --- the M-series roofline (a model) ---

def qwen3_8b_drafter_model(args) -> dict:
    q = QWEN3_8B
    h, hd = q["hidden"], q["head_dim"]
    kv_proj = h * q["kv_heads"] * hd
    layer = 2 * h * q["heads"] * hd + 2 * kv_proj + 3 * h * q["intermediate"]
    head = q["vocab"] * h
    read = q["layers"] * layer + head  # one pass: every layer and the head (not the embedding)
    kv_token = q["layers"] * 2 * q["kv_heads"] * hd * 2  # fp16 keys and values, bytes
    fc = DRAFTER_TAPS * h * h
    drafter_params = DRAFTER_LAYERS * layer + fc
    drafter_kv_token = DRAFTER_LAYERS * 2 * q["kv_heads"] * hd * 2
    bits4 = MLX_4BIT / 8
    model = {
        "label": "MODEL PREDICTION (roofline from peak figures), not a measurement",
        "target": "Qwen3-8B, MLX 4-bit (group 64, 4.5 bits a weight)",
        "target_parameters": q["layers"] * layer + 2 * head,
        "target_weight_gb": round((q["layers"] * layer + 2 * head) * bits4 / 1e9, 3),
        "target_read_gb_per_pass": round(read * bits4 / 1e9, 3),
        "kv_cache_gb": round(kv_token * args.mac_context / 1e9, 3),
        "context": args.mac_context,
        "drafter": f"DFlash, {DRAFTER_LAYERS} layers of the target's width, fc from "
                   f"{DRAFTER_TAPS} taps, block {DRAFTER_BLOCK}",
        "drafter_parameters": drafter_params,
        "drafter_weight_gb": {"bfloat16": round(drafter_params * 2 / 1e9, 3),
                              "4-bit": round(drafter_params * bits4 / 1e9, 3)},
        "head_read_gb": round(head * bits4 / 1e9, 3),
        "bandwidth_efficiency": args.mac_bandwidth_efficiency,
        "compute_efficiency": args.mac_compute_efficiency, "chips": [],
    }
    rows = row_agreement(args.row_agreement)
    for name, gbs, tflops, provenance in CHIPS:
        bandwidth = gbs * 1e9 * args.mac_bandwidth_efficiency
        flops = tflops * 1e12 * args.mac_compute_efficiency

        def target_time(t):
            return max((read * bits4 + kv_token * args.mac_context) / bandwidth,
                       2 * read * t / flops)

        curve = {t: target_time(t) / target_time(1) for t in LENGTHS}
        chip = {"chip": name, "bandwidth_gbs": gbs, "fp16_tflops": tflops,
                "provenance": provenance, "target_step_ms": round(target_time(1) * 1e3, 2),
                "verify_cost": {t: round(c, 3) for t, c in curve.items()},
                "compute_bound_from_T": round(target_time(1) * flops / (2 * read), 1)}
        for precision, per_weight in (("bfloat16", 2.0), ("4-bit", bits4)):
            draft = {}
            for k in KS:
                seconds = max((drafter_params * per_weight + head * bits4 +
                               drafter_kv_token * args.mac_context) / bandwidth,
                              2 * (DRAFTER_LAYERS * layer * DRAFTER_BLOCK +
                                   (fc + DRAFTER_LAYERS * 2 * kv_proj) * (k + 1) +
                                   head * k) / flops)
                cost = seconds / target_time(1)
                draft[k] = {"draft_cost": round(cost, 3),
                            "tokens_per_round": round(tokens_per_round(rows, k), 3),
                            "speedup": round(block_speedup(rows, k, cost, curve), 3)}
            chip[f"drafter {precision}"] = draft
        model["chips"].append(chip)
    return model


def markdown(result: dict) -> str:
    rows = result["row_agreement"]
    lines = ["# DFlash: the cost of a block\n",
             f"`{result['command']}`  \n{result['machine']}, BLAS {result['blas']}, MLX "
             f"{result['mlx']}; shipped target after a {result['context']}-token prefix, "
             f"interleaved medians of {result['repeats']} repeats. Drafter: "
             f"{result['measured']['float16']['drafter']}.\n",
             "## Measured on this machine\n",
             "| dtype | target step (T = 1) | verify cost T = 2 / 4 / 8 / 16 vs T = 1 | drafter "
             "pass vs target step: block, k = 3 / 7 / 15 | with the catch-up of k + 1 rows "
             "(round) |", "|---|---|---|---|---|"]
    for name, m in result["measured"].items():
        vc, dc = m["verify_cost"], m["draft_cost"]
        lines.append(f"| {name} | {m['target_ms'][1]:.2f} ms | "
                     + " / ".join(f"{vc[t]:.2f}" for t in LENGTHS[1:]) + " | "
                     + " / ".join(f"{dc[f'block k={k}']:.2f}" for k in KS) + " | "
                     + " / ".join(f"{dc[f'round k={k}']:.2f}" for k in KS) + " |")
    shown = ", ".join(f"{p:g}" for p in rows[:max(KS)])
    lines += ["", "## Cost model with these measurements\n",
              f"Per-row acceptance p_i = {shown}; speed-up(k) = E[tokens per round] / "
              "(draft cost (round) + verify cost(k + 1)).\n",
              "| dtype | block (k + 1) | E[tokens per round] | draft cost | verify cost | "
              "predicted speed-up |", "|---|---|---|---|---|---|"]
    for name, table in result["cost_model"].items():
        for row in table:
            lines.append(f"| {name} | {row['block']} | {row['tokens_per_round']:.2f} | "
                         f"{row['draft_cost']:.2f} | {row['verify_cost']:.2f} | "
                         f"{row['speedup']:.2f}x |")
    mac = result["mac_model"]
    lines += ["", "## Apple M-series: a MODEL PREDICTION, not a measurement\n",
              f"Roofline: time of a pass = max(bytes / bandwidth, 2 x parameters x T / flops), "
              f"peak figures x efficiency {mac['bandwidth_efficiency']:g} (bandwidth) and "
              f"{mac['compute_efficiency']:g} (compute). Target: {mac['target']}, "
              f"{mac['target_parameters'] / 1e9:.2f} B parameters, {mac['target_weight_gb']:.2f}"
              f" GB of weights, {mac['target_read_gb_per_pass']:.2f} GB read a pass + "
              f"{mac['kv_cache_gb']:.2f} GB of KV cache at {mac['context']} tokens. Drafter: "
              f"{mac['drafter']}, {mac['drafter_parameters'] / 1e9:.2f} B parameters, "
              f"{mac['drafter_weight_gb']['bfloat16']:.2f} GB in bfloat16 "
              f"({mac['drafter_weight_gb']['4-bit']:.2f} GB at 4-bit) + the target's head "
              f"({mac['head_read_gb']:.2f} GB). Same per-row acceptance as above.\n",
              "| chip | GB/s | FP16 TFLOPS | target step | verify cost T = 2 / 4 / 8 / 16 | "
              "draft cost at k = 15, bf16 / 4-bit | speed-up at block 4 / 8 / 16, drafter bf16 | "
              "drafter 4-bit |", "|---|---|---|---|---|---|---|---|"]
    for chip in mac["chips"]:
        bf, q4 = chip["drafter bfloat16"], chip["drafter 4-bit"]
        lines.append(f"| {chip['chip']} | {chip['bandwidth_gbs']:g} | {chip['fp16_tflops']:g} | "
                     f"{chip['target_step_ms']:.1f} ms | "
                     + " / ".join(f"{chip['verify_cost'][t]:.2f}" for t in LENGTHS[1:])
                     + f" | {bf[15]['draft_cost']:.2f} / {q4[15]['draft_cost']:.2f} | "
                     + " / ".join(f"{bf[k]['speedup']:.2f}x" for k in KS) + " | "
                     + " / ".join(f"{q4[k]['speedup']:.2f}x" for k in KS) + " |")
    lines += ["", "Provenance of the chip figures: "
              + "; ".join(f"{c['chip']}: {c['provenance']}" for c in mac["chips"]) + "."]
    return "\n".join(lines) + "\n"


def main():
    args = arguments()
    rows = row_agreement(args.row_agreement)
    measured = {name: measure(dtype, args) for name, dtype in DTYPES.items()}
    flags = f"--out {args.out}"
    if args.row_agreement != "0.6":
        flags = f"--row-agreement {args.row_agreement} " + flags
    if args.dflash:
        flags = f"--dflash {args.dflash} " + flags
    env = " ".join(f"{name}={os.environ[name]}" for name in ("OPENBLAS_NUM_THREADS", "LD_PRELOAD")
                   if os.environ.get(name))
    result = {"command": (env + " " if env else "") +
                         "python -m bench.studies.dflash_cost " + flags,
              "machine": platform.processor() or platform.machine(), "blas": blas_library(),
              "mlx": mx.__version__, "context": args.context, "repeats": args.repeats,
              "row_agreement": rows[:max(KS)], "measured": measured,
              "cost_model": {name: cost_model(m, rows) for name, m in measured.items()},
              "mac_model": qwen3_8b_drafter_model(args)}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS_DIR / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
