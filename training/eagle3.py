"""Train an EAGLE-3 head for the shipped target, in MLX (no PyTorch needed).

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m training.eagle3 [--steps 1000] [--out training/.cache/eagle3/head]

The head (Li et al., 2025; what `mlx_spec.eagle3` reads): `fc` fuses the target's outputs of
three decoder layers (`--taps`, low / mid / high, side by side), one Llama decoder layer whose
attention reads [input_layernorm(e(x_{i+1})) ; hidden_norm(f)], `norm`, `lm_head` over a
draft vocabulary (`--draft-vocab` tokens, the most frequent in the training text; `d2t`
offsets and the `t2d` mask map it to target ids). The target's embedding is shared (not
written). For the pair (h_i, x_{i+1}) at position i the head's output predicts x_{i+2}, i.e.
the target's distribution at position i + 1.

Data: the DFlash drafter's (`training.dflash.prepared`): training-split prompts of 32 tokens
continued greedily for 96 by the shipped target, the taps and the target's final normed
hidden state recorded by one target pass (cached in training/.cache/dflash/).

Training-time test (TTT, as in EAGLE-3): the head is unrolled `--ttt` steps over every
position at once. Step 0 reads the fused taps; step s reads the head's own step s - 1 output
at the same anchor a with the embedding of x_{a+s+1}, at position a + s, and attends to the
step-0 keys of positions 0..a plus its anchor's own keys of steps 1..s (the diagonal), which
is what the drafter's KV cache holds at chained step s. Loss at step s (weight
`--step-decay` ** s): cross-entropy on the target's argmax at position a + s + 1 plus `--kl`
times KL(target || head) there. The embedding fed at later steps is the text's token: a
chain only continues past a draft the target accepted, so at T = 0 that is the draft.

Held-out check (as training.dflash's deployment check): 64-token validation prompts continued
for 64 tokens; from each anchor the head drafts up to 8 tokens teacher-forced on the target's
greedy text, the leading matches are what a greedy round at fixed k accepts, and rounds walk
the continuation as decoding does (`per_round` at k = 2, 4, 8).

Writes the head in the SpecForge layout (the original layout plus `eagle_config` naming the
tapped decoder-layer outputs: the original's default taps, (1, 2, 2) for a 6-layer target,
read one layer twice): config.json and model.safetensors (float16), and metrics.json.
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

from training.dflash import REPO, SEED, load_target, prepared, rope, rounds_mean

EVAL_KS = (2, 4, 8)


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "training" / ".cache" / "eagle3" / "head"))
    ap.add_argument("--sequences", type=int, default=6144, help="target-generated sequences")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--generate-tokens", type=int, default=96)
    ap.add_argument("--taps", default="1,3,5", help="target decoder layers whose outputs are read")
    ap.add_argument("--ffn", type=int, default=768, help="the head's MLP width")
    ap.add_argument("--draft-vocab", type=int, default=2048,
                    help="the draft vocabulary: the tokens most frequent in the training text")
    ap.add_argument("--ttt", type=int, default=3, help="training-time-test steps unrolled")
    ap.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step s: decay**s")
    ap.add_argument("--kl", type=float, default=0.5, help="weight of KL(target || head)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--check-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--evaluate", default=None, metavar="DIR",
                    help="only measure the head in DIR on the held-out text, then stop")
    return ap.parse_args()


# --- the head ----------------------------------------------------------------------------

def draft_vocabulary(sequences: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` target ids most frequent in the text (ties to the lower id), ascending: draft
    id d is target id ids[d], so d2t[d] = ids[d] - d (EAGLE's offset table)."""
    counts = np.bincount(sequences[:, 1:].ravel(), minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def head_config(target, taps, ffn, draft_vocab) -> dict:
    """config.json: SpecForge's layout (the original's Llama config + eagle_config)."""
    a = target.args
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": a.hidden_size, "intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
        "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
        "rope_scaling": None, "max_position_embeddings": 2048, "vocab_size": a.vocab_size,
        "draft_vocab_size": draft_vocab, "target_hidden_size": a.hidden_size,
        "tie_word_embeddings": False, "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(taps),
                         "use_aux_hidden_state": True},
    }


def new_head(config: dict, target, ids: np.ndarray):
    """A fresh head: layer weights random (std 0.02), fc the identity on the last tap (plus
    noise), norm and lm_head copied from the target's final norm and the rows of its output
    head that the draft vocabulary `ids` keeps."""
    from mlx_spec.eagle3 import Eagle3Head, parse_config

    head = Eagle3Head(parse_config(config, "the new head"))
    H = config["hidden_size"]
    for name, value in tree_flatten(head.parameters()):
        if name.endswith("weight") and value.ndim == 2:
            std = 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight")) \
                else 0.02
            head.update(_nested(name, mx.random.normal(value.shape) * std))
    fc = head.fc.weight * 0.5
    head.fc.weight = mx.concatenate([fc[:, :-H], mx.eye(H) + fc[:, -H:]], axis=1)
    head.norm.weight = target.model.norm.weight.astype(mx.float32)
    head.lm_head.weight = target.lm_head.weight[mx.array(ids)].astype(mx.float32)
    head.set_dtype(mx.float32)
    head.set_d2t(mx.array(ids - np.arange(len(ids))))
    return head


def _nested(name: str, value):
    """{'a': {'b': value}} for 'a.b' (Module.update's shape)."""
    out = value
    for part in reversed(name.split(".")):
        out = {part: out}
    return out


# --- the unrolled forward ------------------------------------------------------------------

def unrolled(head, embed, features, tokens, steps, theta):
    """The head's pre-norm outputs [(n, R, H)] for steps 0..steps-1 at every anchor a < R =
    T - 1 (see the module docstring). features (n, T, 3H) float32, tokens (n, T)."""
    n, T = tokens.shape
    R = T - 1
    layer = head.midlayer
    attn = layer.self_attn
    hidden = head.fuse(features[:, :R])  # (n, R, H)
    anchors = mx.arange(R)
    causal = anchors[None, :] > anchors[:, None]  # (R, R): key after query
    own_k, own_v, outputs = [], [], []

    def heads(proj, x):  # (n, R, heads * d) -> (n, heads, R, d); kv heads = heads here
        return proj(x).reshape(n, R, attn.heads, -1).transpose(0, 2, 1, 3)

    for s in range(steps):
        index = mx.minimum(anchors + s + 1, T - 1)
        embeds = embed(tokens[:, index])  # (n, R, H): e(x_{a+s+1})
        normed = layer.hidden_norm(hidden)
        x = mx.concatenate([layer.input_layernorm(embeds), normed], axis=-1)  # (n, R, 2H)
        positions = mx.broadcast_to((anchors + s)[None], (n, R))
        q = rope(heads(attn.q_proj, x), positions, theta)
        k = rope(heads(attn.k_proj, x), positions, theta)
        v = heads(attn.v_proj, x)
        if s == 0:
            k0, v0 = k, v
        else:
            own_k.append(k)
            own_v.append(v)
        scores = mx.where(causal, -1e9, (q @ k0.swapaxes(-1, -2)) * attn.scale)  # (n, h, R, R)
        diagonal = [(q * kk).sum(-1, keepdims=True) * attn.scale for kk in own_k]  # (n,h,R,1)
        p = mx.softmax(mx.concatenate([scores, *diagonal], axis=-1), axis=-1, precise=True)
        out = p[..., :R] @ v0
        for t, vv in enumerate(own_v):
            out = out + p[..., R + t:R + t + 1] * vv
        u = hidden + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(n, R, -1))
        hidden = u + layer.mlp(layer.post_attention_layernorm(u))
        outputs.append(hidden)
    return outputs


def loss_weights(target, finals, kl, ids):
    """w = one-hot(target's argmax) + kl * p_target over the draft vocabulary `ids` (n, T, D),
    from the target's final normed hidden states: -sum(w * log q) is CE on the argmax plus
    kl * KL(p || q) less p's entropy (a constant), restricted to the tokens the head can
    draft (an argmax outside them adds no CE), in one pass over the vocabulary (the CPU
    backend's exp is the slow part)."""
    logits = target.lm_head(finals.astype(mx.float32))
    onehot = (logits == logits.max(axis=-1, keepdims=True)).astype(mx.float32)
    w = onehot + kl * mx.softmax(logits, axis=-1, precise=True) if kl > 0 else onehot
    return mx.take(w, ids, axis=-1)


def soft_cross_entropy(logits, weights):
    """mean over rows of -sum(w * log_softmax(logits))."""
    lse = mx.logsumexp(logits, axis=-1)
    return (weights.sum(-1) * lse - (weights * logits).sum(-1)).mean()


# --- held-out acceptance --------------------------------------------------------------------

def held_out(head, target, data, first, theta, depth=max(EVAL_KS), batch=32):
    """Greedy rounds at k in EVAL_KS walked over the continuation (`per_round`), the mean over
    anchors, and each depth's agreement with the target's greedy token."""
    sequences, features, _ = data
    T = sequences.shape[1]
    hits = []
    for start in range(0, len(sequences), batch):
        tokens = mx.array(sequences[start:start + batch])
        outs = unrolled(head, target.model.embed_tokens, mx.array(features[start:start + batch])
                        .astype(mx.float32), tokens, depth, theta)
        ids = np.array(head.target_ids())
        guesses = np.stack([ids[np.array(mx.argmax(head.draft_logits(g), axis=-1))]
                            for g in outs], axis=-1)  # (n, R, depth): step s at a drafts x_{a+s+2}
        anchors = np.arange(first - 1, T - 2)  # the last pair a: x_{a+1} known, x_{a+2} next
        rows = []
        for s in range(depth):
            label_at = np.minimum(anchors + s + 2, T - 1)
            ok = guesses[:, anchors, s] == sequences[start:start + batch][:, label_at]
            rows.append(ok & (anchors + s + 2 <= T - 1))
        hits.append(np.stack(rows, axis=-1))  # (n, anchors, depth)
    hits = np.concatenate(hits)
    leading = np.cumprod(hits, axis=-1).sum(-1)  # (n, anchors)
    return {"anchors": int(leading.size),
            "per_round": {str(k): round(rounds_mean(leading, k), 3) for k in EVAL_KS},
            "over_anchors": {str(k): round(float(np.minimum(leading, k).mean()), 3)
                             for k in EVAL_KS},
            "step_agreement": [round(float(hits[..., s].mean()), 3) for s in range(depth)]}


def held_out_data(target, taps, say):
    """The deployment-shaped held-out text (training.dflash.deployment_check's)."""
    return prepared(target, "val", 128, 64, 64, taps, SEED + 2, say)


# --- export and the check through mlx_spec ------------------------------------------------

def save_head(out: Path, head, config) -> None:
    """config.json; model.safetensors: the weights in float16, d2t (int64 offsets) and t2d
    (bool, the target ids drafted), as EAGLE writes them."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(head.parameters())}
    t2d = np.zeros(config["vocab_size"], bool)
    t2d[np.array(head.target_ids())] = True
    weights["d2t"] = head.d2t.astype(mx.int64)
    weights["t2d"] = mx.array(t2d)
    mx.save_safetensors(str(out / "model.safetensors"), weights)


def mlx_spec_check(out: Path, head, target, data, theta, say, depth=4) -> dict:
    """The exported head through mlx_spec (loader, head module, its KV cache, the drafter)
    against the training forward on the float16-rounded weights: step 0 at every pair of one
    held-out sequence, then `depth` - 1 chained greedy drafts from its last pair."""
    from mlx_spec.drafters.eagle3 import Eagle3Drafter
    from mlx_spec.eagle3 import check_fits, load_eagle3
    from mlx_spec.sampling import SamplingConfig

    loaded = load_eagle3(str(out))
    check_fits(loaded, target)
    loaded.set_dtype(mx.float32)
    sequences, features, _ = data
    L = sequences.shape[1] - 1 - depth  # pairs 0..L-1, the last one (h_{L-1}, x_L)
    tokens, taps = sequences[0, :L + 1], mx.array(features[0, :L]).astype(mx.float32)
    embed = target.model.embed_tokens
    cache = loaded.make_cache()[0]
    g = loaded(embed(mx.array(tokens[1:])), loaded.fuse(taps), cache)  # (L, H)
    ours = [loaded.draft_logits(g)]  # step 0 at every pair
    drafts = [int(mx.argmax(loaded.logits(g[-1])))]  # target ids
    for _ in range(depth - 1):
        g = loaded(embed(mx.array(drafts[-1:])), g[-1:], cache)
        ours.append(loaded.draft_logits(g))
        drafts.append(int(mx.argmax(loaded.logits(g[-1]))))
    drafter = Eagle3Drafter(loaded, target, SamplingConfig(temp=0.0))
    drafter.follow(tokens[1:].tolist(), taps)
    proposed = np.array(drafter.propose(tokens.tolist(), depth).tokens).tolist()
    # the training forward over the same text with the drafts in place of the text after x_L
    rounded = float16_rounded(head)
    text = np.concatenate([tokens, drafts[:-1]])[None]
    padded = mx.concatenate([taps, mx.zeros((depth - 1, taps.shape[1]))])[None]
    outs = unrolled(rounded, embed, padded, mx.array(text), depth, theta)
    theirs = [rounded.draft_logits(outs[0])[0, :L]] + \
        [rounded.draft_logits(o)[0, L - 1:L] for o in outs[1:]]
    diff = max(float(mx.abs(a - b).max()) for a, b in zip(ours, theirs))
    agree = float(np.mean(np.array(mx.argmax(ours[0], -1)) == np.array(mx.argmax(theirs[0], -1))))
    scale = float(mx.abs(theirs[0]).max())
    say(f"mlx_spec check: max |logit diff| {diff:.2e} (scale {scale:.1f}), "
        f"step-0 argmax agreement {agree:.3f}, drafts {drafts}, the drafter's {proposed}")
    if proposed != drafts:
        raise SystemExit("mlx_spec's drafter drafts other tokens than the head computed by hand.")
    return {"max_abs_logit_diff": diff, "step0_argmax_agreement": agree,
            "chained_drafts": drafts, "drafter_drafts": proposed}


def float16_rounded(head):
    """A copy of `head` whose weights are rounded through float16 (what the file holds)."""
    import copy

    from mlx.utils import tree_unflatten

    rounded = copy.deepcopy(head)
    rounded.update(tree_unflatten([(k, v.astype(mx.float16).astype(mx.float32))
                                   for k, v in tree_flatten(head.parameters())]))
    return rounded


# --- the run --------------------------------------------------------------------------------

def evaluate(directory, say):
    from mlx_spec.eagle3 import load_eagle3

    target = load_target()
    head = load_eagle3(directory)
    head.set_dtype(mx.float32)
    config = json.loads((Path(directory) / "config.json").read_text())
    taps = head.eagle3_config.tap_layers(len(target.model.layers))
    result = held_out(head, target, held_out_data(target, list(taps), say), 64,
                      config["rope_theta"])
    say(f"{directory}: held-out accepted drafts per greedy round {result['per_round']}, "
        f"per-step agreement {result['step_agreement']}")
    return result


def main():
    args = arguments()
    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    start = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)

    if args.evaluate:
        evaluate(args.evaluate, say)
        return
    taps = [int(t) for t in args.taps.split(",")]
    target = load_target()
    sequences, features, finals = prepared(target, "train", args.sequences, args.prompt_tokens,
                                           args.generate_tokens, taps, args.seed, say)
    held = held_out_data(target, taps, say)
    config = head_config(target, taps, args.ffn, args.draft_vocab)
    ids = draft_vocabulary(sequences, args.draft_vocab, target.args.vocab_size)
    held_text = held[0][:, 64:]
    say(f"draft vocabulary: {len(ids)} tokens, covering "
        f"{np.isin(sequences[:, 1:], ids).mean():.4f} of the training text and "
        f"{np.isin(held_text, ids).mean():.4f} of the held-out continuations")
    head = new_head(config, target, ids)
    theta = config["rope_theta"]
    embed = target.model.embed_tokens
    step_weights = [args.step_decay ** s for s in range(args.ttt)]
    T = sequences.shape[1]
    R = T - 1

    def loss_fn(model, feats, tokens, weights):
        total = 0.0
        for s, g in enumerate(unrolled(model, embed, feats, tokens, args.ttt, theta)):
            valid = R - 1 - s  # anchors a <= T - 2 - s have a target position a + s + 1
            total = total + step_weights[s] * soft_cross_entropy(
                model.draft_logits(g[:, :valid]), weights[:, s + 1:s + 1 + valid])
        return total / sum(step_weights)

    schedule = optim.join_schedules(
        [optim.linear_schedule(args.lr / 100, args.lr, args.warmup),
         optim.cosine_decay(args.lr, args.steps - args.warmup, args.lr / 10)], [args.warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    step_fn = nn.value_and_grad(head, loss_fn)
    parameters = sum(v.size for _, v in tree_flatten(head.parameters()))
    say(f"training {parameters:,} parameters for {args.steps} steps, TTT {args.ttt}, taps {taps}")
    out = Path(args.out)
    losses, checks = [], []

    def check(step):
        result = held_out(head, target, held, 64, theta)
        checks.append({"step": step, **result["per_round"]})
        say(f"step {step}: held-out accepted drafts per greedy round {result['per_round']}, "
            f"per-step agreement {result['step_agreement'][:4]}")
        save_head(out, head, config)  # a run stopped early keeps its last check's weights
        return result

    check(0)
    for step in range(args.steps):
        rows = np.sort(rng.choice(len(sequences), args.batch, replace=False))
        weights = loss_weights(target, mx.array(finals[rows]), args.kl, mx.array(ids))
        mx.eval(weights)
        loss, grads = step_fn(head, mx.array(features[rows]).astype(mx.float32),
                              mx.array(sequences[rows]), weights)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        losses.append(float(loss))
        if step % 50 == 0 or step == args.steps - 1:
            say(f"step {step}: loss {np.mean(losses[-50:]):.3f}")
        if (step + 1) % args.check_every == 0 and step + 1 < args.steps:
            check(step + 1)
    final = check(args.steps)
    mlx_check = mlx_spec_check(out, head, target, held, theta, say)
    reproduce = ("OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/"
                 "libopenblas.so.0 python -m training.eagle3 "
                 f"--sequences {args.sequences} --prompt-tokens {args.prompt_tokens} "
                 f"--generate-tokens {args.generate_tokens} --taps {args.taps} --ffn {args.ffn} "
                 f"--draft-vocab {args.draft_vocab} "
                 f"--ttt {args.ttt} --step-decay {args.step_decay} --kl {args.kl} "
                 f"--steps {args.steps} --batch {args.batch} --lr {args.lr} "
                 f"--warmup {args.warmup} --seed {args.seed}")
    metrics = {"reproduce": reproduce, "seconds": round(time.perf_counter() - start, 1),
               "parameters": int(parameters), "taps": taps, "draft_vocab": int(len(ids)),
               "draft_vocab_coverage": {
                   "training_text": round(float(np.isin(sequences[:, 1:], ids).mean()), 4),
                   "held_out_continuations": round(float(np.isin(held_text, ids).mean()), 4)},
               "loss_first_50": round(float(np.mean(losses[:50])), 4),
               "loss_last_50": round(float(np.mean(losses[-50:])), 4),
               "loss_curve": [round(float(np.mean(losses[i:i + 50])), 4)
                              for i in range(0, len(losses), 50)],
               "held_out": final, "held_out_curve": checks, "mlx_spec_check": mlx_check}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    say(f"wrote {out}: loss {metrics['loss_first_50']} -> {metrics['loss_last_50']}")
    if not math.isfinite(metrics["loss_last_50"]):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
