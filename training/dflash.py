"""Train a DFlash block drafter for the shipped target, in MLX (no PyTorch needed).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m training.dflash [--steps 900] [--out mlx_spec/default_models/dflash]

Data: prompts from the training split of the standard-library corpus
(`training.data`, the same split and tokenizer as the shipped models), each
continued greedily by the shipped target, so the text the drafter learns is
the target's own output. The target's layer outputs at `--taps` are computed
once per sequence (float32: MLX's CPU backend uses BLAS only for float32).

A training example is a block: an anchor position c in the generated part,
the context = the target's taps at positions 0..c-1, the block =
[token c] + [mask] * (B - 1), the labels = tokens c+1..c+B-1. Several blocks
per sequence are trained at once with one attention mask (a block sees the
context before its anchor and its own rows, bidirectionally), exactly the
computation `mlx_spec.drafters.dflash` runs at inference. The loss is the
cross-entropy of each block row, weighted exp(-(i - 1) / DECAY) by its
position i (early rows decide the accepted length). The drafter's layers start
from copies of the target's last layers (q_norm/k_norm at one), fc and the
norms from scratch.

Writes config.json (z-lab's DFlashDraftModel layout) and model.safetensors
(float16) to --out, and metrics.json with the run's settings and losses.
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
DECAY = 4.0
SEED = 1234


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
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--init", default=None, help="continue from the drafter a previous run wrote")
    return ap.parse_args()


def load_target():
    import mlx_spec

    target, _ = mlx_spec.load(str(TARGET_DIR))
    target.set_dtype(mx.float32)
    target.freeze()
    return target


def training_prompts(n, length, seed):
    from tokenizers import Tokenizer

    from training.data import encode_stream, load_corpus, make_prompts

    _, train, _ = load_corpus()
    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    ids = encode_stream(tok, [t for _, t in train], 0)
    return np.stack(make_prompts(ids, n, length, seed, 0, 96))


def generate(target, prompts: np.ndarray, count: int, batch: int = 256) -> np.ndarray:
    """Greedy continuations of `count` tokens for every prompt, batched."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for start in range(0, len(prompts), batch):
        x = mx.array(prompts[start:start + batch])
        cache = make_prompt_cache(target)
        logits = target(x, cache=cache)[:, -1]
        rows = []
        for _ in range(count):
            token = mx.argmax(logits, axis=-1)
            rows.append(token)
            logits = target(token[:, None], cache=cache)[:, -1]
            mx.eval(logits)
        out.append(np.concatenate([prompts[start:start + batch],
                                   np.array(mx.stack(rows, axis=1))], axis=1))
    return np.concatenate(out)


def target_taps(target, sequences: np.ndarray, taps, batch: int = 128) -> np.ndarray:
    from mlx_spec.dflash import tapped

    out = []
    for start in range(0, len(sequences), batch):
        with tapped(target, taps) as outputs:
            target(mx.array(sequences[start:start + batch]))
        rows = mx.concatenate([outputs[i] for i in taps], axis=-1).astype(mx.float16)
        out.append(np.array(rows))
    return np.concatenate(out)


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


def rope(x, positions, theta):
    """NeoX-style rotary embedding of x (n, heads, T, d) at positions (n, T)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    angles = positions[:, None, :, None].astype(mx.float32) * inv  # (n, 1, T, d/2)
    cos, sin = mx.cos(angles), mx.sin(angles)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def block_logits(drafter, embed, head, taps, blocks, anchors, theta):
    """Logits (n, M * B, V) of M blocks per sequence; taps (n, T, KH), blocks (n, M, B)."""
    n, T, _ = taps.shape
    M, B = blocks.shape[1:]
    context = drafter.hidden_norm(drafter.fc(taps))  # (n, T, H)
    x = embed(blocks.reshape(n, M * B))  # (n, MB, H)
    block_pos = (anchors[..., None] + mx.arange(B)).reshape(n, M * B)
    context_pos = mx.broadcast_to(mx.arange(T)[None], (n, T))
    # block m sees context rows j < anchor_m and its own rows
    sees_context = mx.arange(T)[None, None, :] < mx.repeat(anchors, B, axis=1)[..., None]
    owner = mx.repeat(mx.arange(M), B)
    sees_block = mx.broadcast_to((owner[:, None] == owner[None, :])[None], (n, M * B, M * B))
    mask = mx.concatenate([sees_context, sees_block], axis=-1)[:, None]  # (n, 1, MB, T + MB)
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)

        def heads(proj, rows, count):
            return proj(rows).reshape(n, rows.shape[1], count, -1).transpose(0, 2, 1, 3)

        q = rope(attn.q_norm(heads(attn.q_proj, h, attn.heads)), block_pos, theta)
        keys = mx.concatenate([
            rope(attn.k_norm(heads(attn.k_proj, context, attn.kv_heads)), context_pos, theta),
            rope(attn.k_norm(heads(attn.k_proj, h, attn.kv_heads)), block_pos, theta)], axis=2)
        values = mx.concatenate([heads(attn.v_proj, context, attn.kv_heads),
                                 heads(attn.v_proj, h, attn.kv_heads)], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, M * B, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head(drafter.norm(x))


def sample_blocks(rng, sequences, first, block_size, mask_id, count):
    """Anchors (n, M) in the generated part and their blocks and labels (n, M, B)."""
    n, T = sequences.shape
    anchors = np.stack([np.sort(rng.choice(np.arange(first, T - block_size + 1), count,
                                           replace=False)) for _ in range(n)])
    index = anchors[..., None] + np.arange(block_size)  # (n, M, B)
    labels = np.take_along_axis(sequences[:, None, :], index, axis=2)
    blocks = np.full_like(labels, mask_id)
    blocks[..., 0] = labels[..., 0]
    return anchors, blocks, labels


def main():
    args = arguments()
    taps = [int(t) for t in args.taps.split(",")]
    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    start = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)

    target = load_target()
    vocab = target.args.vocab_size
    mask_id = vocab - 1  # the shipped vocabulary has no spare token: the last id is the mask
    say(f"prompts: {args.sequences} x {args.prompt_tokens} tokens from the training split")
    prompts = training_prompts(args.sequences, args.prompt_tokens, args.seed)
    say("the target continues them greedily")
    sequences = generate(target, prompts, args.generate_tokens)
    say(f"taps {taps} of {sequences.shape[0]} x {sequences.shape[1]} tokens")
    features = target_taps(target, sequences, taps)

    from mlx_spec.dflash import DFlashModel, parse_config

    config = drafter_config(target, taps, args.layers, args.block_size, mask_id)
    drafter = DFlashModel(parse_config(config))
    init_from_target(drafter, target)
    previous = None
    if args.init:  # a second stage: the weights and settings of the first
        from mlx_spec.dflash import load_dflash

        drafter = load_dflash(args.init)
        drafter.set_dtype(mx.float32)
        config = json.loads((Path(args.init) / "config.json").read_text())
        previous = json.loads((Path(args.init) / "metrics.json").read_text())
    embed, head = target.model.embed_tokens, target.lm_head
    theta = config["rope_theta"]
    B = args.block_size
    weights = mx.array(np.exp(-np.arange(B - 1) / DECAY), mx.float32)  # rows 1..B-1

    def loss_fn(model, taps_, blocks, anchors, labels):
        logits = block_logits(model, embed, head, taps_, blocks, anchors, theta)
        n, M = blocks.shape[:2]
        logits = logits.reshape(n, M, B, -1)[:, :, 1:]
        ce = nn.losses.cross_entropy(logits, labels[:, :, 1:], reduction="none")  # (n, M, B-1)
        return (ce * weights).sum() / (weights.sum() * n * M)

    optimizer = optim.AdamW(learning_rate=optim.cosine_decay(args.lr, args.steps), weight_decay=0.0)
    step_fn = nn.value_and_grad(drafter, loss_fn)
    say(f"training {sum(v.size for _, v in tree_flatten(drafter.parameters())):,} parameters "
        f"for {args.steps} steps")
    losses = []
    first = args.prompt_tokens
    for step in range(args.steps):
        rows = rng.choice(len(sequences), args.batch, replace=False)
        anchors, blocks, labels = sample_blocks(rng, sequences[rows], first, B, mask_id,
                                                args.blocks)
        loss, grads = step_fn(drafter, mx.array(features[rows]).astype(mx.float32),
                              mx.array(blocks), mx.array(anchors), mx.array(labels))
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss)
        losses.append(float(loss))
        if step % 100 == 0 or step == args.steps - 1:
            say(f"step {step}: loss {np.mean(losses[-100:]):.3f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in tree_flatten(drafter.parameters())})
    reproduce = ("OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                 "libopenblas.so.0 "
                 f"python -m training.dflash --sequences {args.sequences} --prompt-tokens "
                 f"{args.prompt_tokens} --generate-tokens {args.generate_tokens} --block-size {B} "
                 f"--taps {args.taps} --layers {args.layers} --steps {args.steps} --batch "
                 f"{args.batch} --blocks {args.blocks} --lr {args.lr} --seed {args.seed}"
                 + (" --init FIRST_STAGE_DIR" if args.init else ""))
    metrics = {"reproduce": reproduce, "seconds": round(time.perf_counter() - start, 1),
               "loss_first_100": round(float(np.mean(losses[:100])), 4),
               "loss_last_100": round(float(np.mean(losses[-100:])), 4),
               "parameters": int(sum(v.size for _, v in tree_flatten(drafter.parameters()))),
               "mask_token_id": mask_id, "taps": taps, "block_size": B,
               "loss_curve": [round(float(np.mean(losses[i:i + 100])), 4)
                              for i in range(0, len(losses), 100)]}
    if previous is not None:
        metrics["first_stage"] = previous
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    say(f"wrote {out}: loss {metrics['loss_first_100']} -> {metrics['loss_last_100']}")
    if not math.isfinite(metrics["loss_last_100"]):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
