"""Train a DFlash block drafter for the shipped target, in MLX (no PyTorch needed).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m training.dflash [--steps 900] [--out mlx_spec/default_models/dflash]

Data: prompts from the training split of the standard-library corpus
(`training.data`, the same split and tokenizer as the shipped models), each
continued greedily by the shipped target, so the text the drafter learns is
the target's own output. One target pass per sequence records the taps
(`--taps`, layer outputs) and the target's final normed hidden state, from
which the target's next-token distribution at every position is recomputed
during training (float32: MLX's CPU backend uses BLAS only for float32). The
prepared data is cached in training/.cache/dflash/.

A training example is a block: an anchor position c in the generated part,
the context = the target's taps at positions 0..c-1, the block =
[token c] + [mask] * (B - 1), the labels = tokens c+1..c+B-1. Several blocks
per sequence are trained at once with one attention mask (a block sees the
context before its anchor and its own rows, bidirectionally), exactly the
computation `mlx_spec.drafters.dflash` runs at inference. The loss of block
row i is weighted exp(-(i - 1) / decay) (early rows decide the accepted
length): cross-entropy on the target's greedy token plus `--kl` times
KL(target || drafter) on the target's whole distribution there. The drafter's
layers start from copies of the target's last layers (q_norm/k_norm at one),
fc and the norms from scratch.

Held-out check: prompts from the validation modules, continued by the target
the same way; at anchors spread over the generated part the drafter fills its
block and the leading rows that equal the target's greedy tokens are what a
greedy round at fixed k would accept (the target's continuation IS its greedy
output), so accepted drafts at blocks 4, 8 and 16 are exact at each anchor. A mean
over anchors overstates what decoding sees (its rounds start where the last one ended,
so an easy stretch counts once, not once per position): `--evaluate DIR` and the end of
a run also walk 64-token held-out prompts continued for 64 tokens round by round
(`per_round`), the figure end-to-end runs reproduce.

Writes config.json (z-lab's DFlashDraftModel layout) and model.safetensors
(float16) to --out, and metrics.json with the run's settings, losses and the
held-out acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "mlx_spec" / "default_models" / "target"
CACHE = REPO / "training" / ".cache" / "dflash"
SEED = 1234
EVAL_BLOCKS = (4, 8, 16)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "mlx_spec" / "default_models" / "dflash"))
    ap.add_argument("--sequences", type=int, default=1536, help="target-generated sequences")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--generate-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--taps", default="1,3,4", help="target layers whose outputs are read")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers")
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--blocks", type=int, default=6, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up")
    ap.add_argument("--decay", type=float, default=4.0, help="row weights exp(-(i-1)/decay)")
    ap.add_argument("--kl", type=float, default=0.0, help="weight of KL(target || drafter)")
    ap.add_argument("--eval-sequences", type=int, default=128, help="held-out sequences")
    ap.add_argument("--fc-init", choices=("random", "last"), default="random",
                    help="last: fc starts as the identity on the last tap (others near zero)")
    ap.add_argument("--causal", action="store_true",
                    help="causal inside the block (is_causal: true): a block cut short is "
                         "exact, so steps cycle through --lengths with as many rows each")
    ap.add_argument("--lengths", default="16", help="block lengths the steps cycle through "
                    "(with --causal), each step --blocks * block-size rows per sequence")
    ap.add_argument("--seed", type=int, default=SEED)
    add_sampled_arguments(ap)
    ap.add_argument("--init", default=None, help="continue from the drafter a previous run wrote")
    ap.add_argument("--grow", type=_checked(int, lambda v: v >= 0, ">= 0"), default=0,
                    help="with --init: append this many layers that start as the identity "
                         "(copies of the target's last layers, o_proj and down_proj zero)")
    ap.add_argument("--evaluate", default=None, metavar="DIR",
                    help="only measure the drafter in DIR on both held-out sets, then stop")
    return ap.parse_args()


def add_sampled_arguments(ap) -> None:
    """Sampled text beside the greedy text (both stages)."""
    ap.add_argument("--sampled-sequences", type=_checked(int, lambda v: v >= 0, ">= 0"), default=0,
                    help="also this many prompts continued by SAMPLING from the target at "
                         "--sample-temp (seed --seed + 1): text as decoding at T > 0 meets it")
    ap.add_argument("--sample-temp", type=_checked(float, lambda v: v > 0, "> 0"),
                    default=1.0)


def _checked(kind, holds, says):
    """An argparse type: `kind(text)`, refused in one sentence unless it `holds` (`says`)."""
    def parse(text):
        value = kind(text)
        if not holds(value):
            raise argparse.ArgumentTypeError(f"must be {says}, got {text}")
        return value
    return parse


def sampled_flags(args) -> str:
    """The sampled-text flags of a reproduce line ('' with none)."""
    if not args.sampled_sequences:
        return ""
    return f" --sampled-sequences {args.sampled_sequences} --sample-temp {args.sample_temp}"


def training_data(target, args, taps, say):
    """(sequences, taps, final hidden) of the greedy training text (--sequences, --seed),
    followed by the sampled text (--sampled-sequences at --sample-temp, seed --seed + 1)."""
    data = prepared(target, "train", args.sequences, args.prompt_tokens, args.generate_tokens,
                    taps, args.seed, say)
    if not args.sampled_sequences:
        return data
    sampled = prepared(target, "train", args.sampled_sequences, args.prompt_tokens,
                       args.generate_tokens, taps, args.seed + 1, say, temp=args.sample_temp)
    return tuple(np.concatenate([a, b]) for a, b in zip(data, sampled))


def load_target():
    import mlx_spec

    target, _ = mlx_spec.load(str(TARGET_DIR))
    target.set_dtype(mx.float32)
    target.freeze()
    return target


def corpus_prompts(n, length, seed, split):
    """n prompts of `length` tokens from the corpus's training or validation split."""
    from tokenizers import Tokenizer

    from training.data import encode_stream, load_corpus, make_prompts

    _, train, val = load_corpus()
    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    ids = encode_stream(tok, [t for _, t in (train if split == "train" else val)], 0)
    return np.stack(make_prompts(ids, n, length, seed, 0, 96))


def generate(target, prompts: np.ndarray, count: int, batch: int = 256,
             temp: float = 0.0, seed: int = 0) -> np.ndarray:
    """Continuations of `count` tokens for every prompt, batched: greedy, or sampled at `temp`
    (keys from `seed`)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    key = mx.random.key(seed)
    for start in range(0, len(prompts), batch):
        x = mx.array(prompts[start:start + batch])
        cache = make_prompt_cache(target)
        logits = target(x, cache=cache)[:, -1]
        rows = []
        for _ in range(count):
            if temp > 0:
                key, draw = mx.random.split(key)
                token = mx.random.categorical(logits * (1.0 / temp), axis=-1, key=draw)
            else:
                token = mx.argmax(logits, axis=-1)
            rows.append(token)
            logits = target(token[:, None], cache=cache)[:, -1]
            mx.eval(logits)
        out.append(np.concatenate([prompts[start:start + batch],
                                   np.array(mx.stack(rows, axis=1))], axis=1))
    return np.concatenate(out)


def target_rows(target, sequences: np.ndarray, taps, batch: int = 128):
    """(taps side by side (n, T, len(taps) * H), final normed hidden (n, T, H)), float16."""
    from mlx_spec.dflash import tapped

    features, finals = [], []
    for start in range(0, len(sequences), batch):
        with tapped(target, taps) as outputs:
            final = target.model(mx.array(sequences[start:start + batch]))
        rows = mx.concatenate([outputs[i] for i in taps], axis=-1).astype(mx.float16)
        features.append(np.array(rows))
        finals.append(np.array(final.astype(mx.float16)))
    return np.concatenate(features), np.concatenate(finals)


def prepared(target, split, n, prompt_tokens, generate_tokens, taps, seed, say,
             temp: float = 0.0):
    """(sequences, taps, final hidden) for n prompts of `split`; the sequences are cached on
    disk (the target's continuations: greedy, or sampled at `temp`), the rows recomputed from
    them."""
    sampled = f"-T{temp:g}" if temp > 0 else ""
    path = CACHE / f"{split}-n{n}-p{prompt_tokens}-g{generate_tokens}-s{seed}{sampled}.npy"
    if path.exists():
        sequences = np.load(path)
    else:
        how = f"sampled at T = {temp:g}" if temp > 0 else "greedily"
        say(f"{split}: {n} prompts x {prompt_tokens} tokens, continued {how} by the target")
        sequences = generate(target, corpus_prompts(n, prompt_tokens, seed, split),
                             generate_tokens, temp=temp, seed=seed)
        CACHE.mkdir(parents=True, exist_ok=True)
        np.save(path, sequences)
    rows = path.with_name(path.stem + f"-t{'_'.join(map(str, taps))}.npz")
    if not rows.exists():
        features, finals = target_rows(target, sequences, taps)
        np.savez(rows, features=features, finals=finals)
    data = np.load(rows)
    return sequences, data["features"], data["finals"]


def drafter_config(target, taps, layers, block_size, mask_token_id):
    a = target.args
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": a.hidden_size, "intermediate_size": a.intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": None,
        "vocab_size": a.vocab_size, "num_target_layers": len(target.model.layers),
        "block_size": block_size, "torch_dtype": "float16",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(taps),
                          "block_size": block_size},
    }


def init_from_target(drafter, target):
    """The drafter's layers start as copies of the target's last layers."""
    source = target.model.layers[-len(drafter.layers):]
    for mine, theirs in zip(drafter.layers, source):
        weights = dict(tree_flatten(theirs.parameters()))
        mine.load_weights([(k, v) for k, v in weights.items()], strict=False)


def grown(drafter, config, extra: int, target):
    """`drafter` with `extra` more layers after its own, each starting as the identity: a copy
    of one of the target's last layers whose o_proj and down_proj are zero, so the grown
    drafter computes exactly what `drafter` did and training moves the new layers off zero."""
    from mlx_spec.dflash import DFlashModel, parse_config

    config = {**config, "num_hidden_layers": config["num_hidden_layers"] + extra}
    bigger = DFlashModel(parse_config(config))
    init_from_target(bigger, target)
    bigger.set_dtype(mx.float32)
    old = len(drafter.layers)
    weights = dict(tree_flatten(drafter.parameters()))
    for layer in bigger.layers[old:]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    bigger.load_weights(list(weights.items()), strict=False)  # its own layers, fc, norms
    return bigger, config


def rope(x, positions, theta):
    """NeoX-style rotary embedding of x (n, heads, T, d) at positions (n, T)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = positions[:, None, :, None].astype(mx.float32) * inv  # (n, 1, T, d/2)
    cos, sin = mx.cos(angles), mx.sin(angles)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def block_rows(drafter, embed, taps, blocks, anchors, theta, causal=False):
    """The drafter's normed rows (n, M * B, H) of M blocks per sequence; taps (n, T, KH),
    blocks (n, M, B): the computation mlx_spec.drafters.dflash runs, M blocks at once. Each
    block's queries see the context rows before its anchor and its own B rows (attention to
    the context and inside each block computed apart, then one softmax over both)."""
    n, T, _ = taps.shape
    M, B = blocks.shape[1:]
    context = drafter.hidden_norm(drafter.fc(taps))  # (n, T, H)
    x = embed(blocks.reshape(n, M * B))  # (n, MB, H)
    block_pos = (anchors[..., None] + mx.arange(B)).reshape(n, M * B)
    context_pos = mx.broadcast_to(mx.arange(T)[None], (n, T))
    later = mx.arange(B)[None, :] > mx.arange(B)[:, None]  # (B, B): key after query
    # block m's rows do not see context rows at or after its anchor: (n, 1, MB, T)
    hidden = (mx.arange(T)[None, None, :] >= mx.repeat(anchors, B, axis=1)[..., None])[:, None]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)

        def heads(proj, rows, count):
            out = proj(rows).reshape(n, rows.shape[1], count, -1).transpose(0, 2, 1, 3)
            return mx.repeat(out, attn.heads // count, axis=1) if count != attn.heads else out

        q = rope(attn.q_norm(heads(attn.q_proj, h, attn.heads)), block_pos, theta)
        k_ctx = rope(attn.k_norm(heads(attn.k_proj, context, attn.kv_heads)), context_pos, theta)
        k_blk = rope(attn.k_norm(heads(attn.k_proj, h, attn.kv_heads)), block_pos, theta)
        v_ctx, v_blk = heads(attn.v_proj, context, attn.kv_heads), heads(attn.v_proj, h,
                                                                          attn.kv_heads)
        s_ctx = (q @ k_ctx.swapaxes(-1, -2)) * attn.scale  # (n, heads, MB, T)
        s_ctx = mx.where(hidden, -1e9, s_ctx)
        q_b = q.reshape(n, attn.heads, M, B, -1)
        s_blk = (q_b @ k_blk.reshape(n, attn.heads, M, B, -1).swapaxes(-1, -2)) * attn.scale
        if causal:
            s_blk = mx.where(later, -1e9, s_blk)
        scores = mx.concatenate([s_ctx.reshape(n, attn.heads, M, B, T), s_blk], axis=-1)
        p = mx.softmax(scores, axis=-1, precise=True)
        out = p[..., :T].reshape(n, attn.heads, M * B, T) @ v_ctx + \
            (p[..., T:] @ v_blk.reshape(n, attn.heads, M, B, -1)).reshape(n, attn.heads, M * B, -1)
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, M * B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def block_logits(drafter, embed, head, taps, blocks, anchors, theta, causal=False):
    """Logits (n, M * B, V) of M blocks per sequence (see block_rows)."""
    return head(block_rows(drafter, embed, taps, blocks, anchors, theta, causal))


def sample_blocks(rng, sequences, first, block_size, mask_id, count):
    """Anchors (n, M) in the generated part and their blocks and labels (n, M, B)."""
    n, T = sequences.shape
    anchors = np.stack([np.sort(rng.choice(np.arange(first, T - block_size + 1), count,
                                           replace=False)) for _ in range(n)])
    return anchors, *blocks_at(sequences, anchors, block_size, mask_id)


def blocks_at(sequences, anchors, block_size, mask_id):
    """The blocks [token c] + [mask] * (B - 1) and labels tokens c..c+B-1 at anchors (n, M)."""
    index = anchors[..., None] + np.arange(block_size)  # (n, M, B)
    labels = np.take_along_axis(sequences[:, None, :], index, axis=2)
    blocks = np.full_like(labels, mask_id)
    blocks[..., 0] = labels[..., 0]
    return blocks, labels


def held_out_acceptance(drafter, embed, head, data, first, block_size, mask_id, theta,
                        causal=False, stride=4, batch=16):
    """Mean accepted drafts per greedy round at each block in EVAL_BLOCKS, and the per-row
    agreement with the target's greedy token, over anchors every `stride` positions."""
    sequences, features, _ = data
    T = sequences.shape[1]
    anchors = np.arange(first, T - block_size + 1, stride)
    hits = []
    for start in range(0, len(sequences), batch):
        rows = np.arange(start, min(start + batch, len(sequences)))
        a = np.broadcast_to(anchors, (len(rows), len(anchors)))
        blocks, labels = blocks_at(sequences[rows], a, block_size, mask_id)
        logits = block_logits(drafter, embed, head, mx.array(features[rows]).astype(mx.float32),
                              mx.array(blocks), mx.array(a), theta, causal)
        guess = np.array(mx.argmax(logits, axis=-1)).reshape(labels.shape)
        hits.append((guess[..., 1:] == labels[..., 1:]).reshape(-1, block_size - 1))
    hits = np.concatenate(hits)  # (anchors, B - 1)
    leading = np.cumprod(hits, axis=1).sum(axis=1)
    result = {"anchors": int(len(hits)),
              "accepted": {str(b): round(float(np.minimum(leading, b - 1).mean()), 3)
                           for b in EVAL_BLOCKS if b <= block_size},
              "row_agreement": [round(float(v), 3) for v in hits.mean(axis=0)]}
    if stride == 1:  # rounds as decoding meets them: each starts where the last one ended
        result["per_round"] = {str(b): round(rounds_mean(leading.reshape(len(sequences), -1),
                                                         b - 1), 3)
                               for b in EVAL_BLOCKS if b <= block_size}
    return result


def rounds_mean(leading: np.ndarray, k: int) -> float:
    """Mean accepted drafts per greedy round at fixed k, walking each sequence as decoding
    does (a round at anchor i accepts a = min(k, leading[i]) and the next starts at
    i + a + 1). Rounds land less often in easy stretches, where they accept more, than a
    mean over every anchor does."""
    accepted = []
    for row in leading:
        i = 0
        while i < len(row):
            accepted.append(min(k, int(row[i])))
            i += accepted[-1] + 1
    return float(np.mean(accepted))


def deployment_check(target, drafter, config, say):
    """Held-out acceptance on deployment-shaped text: 64-token validation prompts continued
    for 64 tokens (the shape of bench.studies.dflash_acceptance's prompts), at every
    anchor of the continuation and per round as greedy decoding walks it."""
    taps = list(config["dflash_config"]["target_layer_ids"])
    data = prepared(target, "val", 128, 64, 64, taps, SEED + 2, say)
    return held_out_acceptance(drafter, target.model.embed_tokens, target.lm_head, data, 64,
                               config["dflash_config"]["block_size"],
                               config["dflash_config"]["mask_token_id"], config["rope_theta"],
                               bool(config.get("is_causal")), stride=1)


def evaluate(directory, say):
    from mlx_spec.dflash import load_dflash

    target = load_target()
    drafter = load_dflash(directory)
    if drafter.dflash_config.dflash2 is not None:  # its selector changes the drafts
        raise SystemExit(f"{directory} is a DFlash2 drafter: `python -m "
                         f"training.dflash_selector --evaluate {directory}` measures it.")
    drafter.set_dtype(mx.float32)
    config = json.loads((Path(directory) / "config.json").read_text())
    result = deployment_check(target, drafter, config, say)
    out = REPO / "bench" / "results" / f"dflash-heldout-{Path(directory).resolve().name}.json"
    out.write_text(json.dumps({"command": f"python -m training.dflash --evaluate {directory}",
                               "drafter": str(directory), **result}, indent=2) + "\n")
    say(f"{directory}: deployment-shaped held-out accepted drafts: per round "
        f"{result['per_round']}, mean over anchors {result['accepted']}, row agreement "
        f"{result['row_agreement']}")
    return result


def save_drafter(out: Path, drafter, config) -> None:
    """config.json and model.safetensors (float16) in the published layout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in tree_flatten(drafter.parameters())})


def main():
    args = arguments()
    if args.grow and not args.init:  # before minutes of data preparation
        raise SystemExit("--grow adds layers to a trained drafter: pass --init DIR too.")
    taps = [int(t) for t in args.taps.split(",")]
    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    start = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)

    if args.evaluate:
        evaluate(args.evaluate, say)
        return
    target = load_target()
    vocab = target.args.vocab_size
    mask_id = vocab - 1  # the shipped vocabulary has no spare token: the last id is the mask
    data = training_data(target, args, taps, say)
    held_out = prepared(target, "val", args.eval_sequences, args.prompt_tokens,
                        args.generate_tokens, taps, SEED + 1, say)
    sequences, features, finals = data

    from mlx_spec.dflash import DFlashModel, parse_config

    config = drafter_config(target, taps, args.layers, args.block_size, mask_id)
    if args.causal:
        config["is_causal"] = True
    drafter = DFlashModel(parse_config(config))
    init_from_target(drafter, target)
    if args.fc_init == "last":  # the context starts as the last tapped layer's output
        H = target.args.hidden_size
        weight = drafter.fc.weight * 0.01
        drafter.fc.weight = mx.concatenate([weight[:, :-H], mx.eye(H)], axis=1)
    previous = None
    if args.init:  # a later stage: the weights and settings of the one before
        from mlx_spec.dflash import load_dflash

        drafter = load_dflash(args.init)
        drafter.set_dtype(mx.float32)
        config = json.loads((Path(args.init) / "config.json").read_text())
        previous = json.loads((Path(args.init) / "metrics.json").read_text())
        if args.grow:
            drafter, config = grown(drafter, config, args.grow, target)
    embed, head = target.model.embed_tokens, target.lm_head
    theta = config["rope_theta"]
    B = args.block_size
    first = args.prompt_tokens
    causal = bool(config.get("is_causal"))
    lengths = [int(b) for b in args.lengths.split(",")] if causal else [B]
    weights = mx.array(np.exp(-np.arange(B - 1) / args.decay), mx.float32)  # rows 1..B-1

    def loss_fn(model, taps_, blocks, anchors, labels, target_final):
        logits = block_logits(model, embed, head, taps_, blocks, anchors, theta, causal)
        n, M, b = blocks.shape
        logits = logits.reshape(n, M, b, -1)[:, :, 1:]
        weights_ = weights[:b - 1]
        ce = nn.losses.cross_entropy(logits, labels[:, :, 1:], reduction="none")  # (n, M, B-1)
        if args.kl > 0:  # the target's distribution at the position before each label
            p = mx.softmax(head(target_final), axis=-1)
            log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            ce = ce + args.kl * (p * (mx.log(p + 1e-9) - log_q)).sum(axis=-1)
        return (ce * weights_).sum() / (weights_.sum() * n * M)

    schedule = optim.cosine_decay(args.lr, args.steps - args.warmup)
    if args.warmup:
        schedule = optim.join_schedules([optim.linear_schedule(args.lr / 100, args.lr,
                                                               args.warmup), schedule],
                                        [args.warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    step_fn = nn.value_and_grad(drafter, loss_fn)
    say(f"training {sum(v.size for _, v in tree_flatten(drafter.parameters())):,} parameters "
        f"for {args.steps} steps")
    losses, checks = [], []

    out = Path(args.out)

    def check(step):
        result = held_out_acceptance(drafter, embed, head, held_out, first, B, mask_id, theta,
                                     causal)
        checks.append({"step": step, **result["accepted"]})
        say(f"step {step}: held-out accepted drafts over anchors {result['accepted']}")
        save_drafter(out, drafter, config)  # a run stopped early keeps its last check's weights
        return result

    for step in range(args.steps):
        rows = rng.choice(len(sequences), args.batch, replace=False)
        b = lengths[step % len(lengths)]
        M = args.blocks * B // b
        anchors, blocks, labels = sample_blocks(rng, sequences[rows], first, B, mask_id, M)
        blocks, labels = blocks[..., :b], labels[..., :b]
        before = (anchors[..., None] + np.arange(b - 1)).reshape(len(rows), -1)  # c+i <- c+i-1
        target_final = np.take_along_axis(finals[rows], before[..., None], axis=1)
        target_final = target_final.reshape(len(rows), M, b - 1, -1)
        loss, grads = step_fn(drafter, mx.array(features[rows]).astype(mx.float32),
                              mx.array(blocks), mx.array(anchors), mx.array(labels),
                              mx.array(target_final).astype(mx.float32))
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            say(f"step {step}: loss {np.mean(losses[-100:]):.3f}")
        if step % 500 == 499 and step + 1 < args.steps:
            check(step + 1)
    final_check = check(args.steps)
    deployment = deployment_check(target, drafter, config, say)
    say(f"deployment-shaped held-out accepted drafts per round {deployment['per_round']}")

    save_drafter(out, drafter, config)
    reproduce = ("OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                 "libopenblas.so.0 "
                 f"python -m training.dflash --sequences {args.sequences} --prompt-tokens "
                 f"{args.prompt_tokens} --generate-tokens {args.generate_tokens} --block-size {B} "
                 f"--taps {args.taps} --layers {args.layers} --steps {args.steps} --batch "
                 f"{args.batch} --blocks {args.blocks} --lr {args.lr} --warmup {args.warmup} "
                 f"--decay {args.decay} --kl {args.kl} --fc-init {args.fc_init} "
                 + (f"--causal --lengths {args.lengths} " if causal else "")
                 + f"--seed {args.seed}" + sampled_flags(args)
                 + (" --init PREVIOUS_STAGE_DIR" if args.init else "")
                 + (f" --grow {args.grow}" if args.grow else ""))
    metrics = {"reproduce": reproduce, "seconds": round(time.perf_counter() - start, 1),
               "loss_first_100": round(float(np.mean(losses[:100])), 4),
               "loss_last_100": round(float(np.mean(losses[-100:])), 4),
               "parameters": int(sum(v.size for _, v in tree_flatten(drafter.parameters()))),
               "mask_token_id": mask_id, "taps": taps, "block_size": B,
               "loss_curve": [round(float(np.mean(losses[i:i + 100])), 4)
                              for i in range(0, len(losses), 100)],
               "held_out": final_check, "held_out_curve": checks,
               "held_out_deployment": deployment}
    if previous is not None:
        metrics["previous_stage"] = previous
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    say(f"wrote {out}: loss {metrics['loss_first_100']} -> {metrics['loss_last_100']}")
    if not math.isfinite(metrics["loss_last_100"]):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
