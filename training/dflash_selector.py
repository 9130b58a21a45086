"""Give a trained DFlash drafter DFlash2's candidate selector: a block drafter whose drafts
depend on the drafts before them.

    OPENBLAS_NUM_THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m training.dflash_selector --init DFLASH_DIR --out OUT_DIR
    python -m training.dflash_selector --evaluate DIR    # held-out acceptance only

A DFlash drafter fills its block in one pass, so row i cannot know which token
row i - 1 drafted: where the text could go two ways, rows after the first mix
them. DFlash2's selector (`mlx_spec.dflash.dflash2.CandidateSelector`, the
published `DFlash2DraftModel` layout) walks the block left to right: row i's
`selector_top_k` highest logits are re-scored as

    logit(c) + < predecessor_codebook[previous] * hidden_projection(h_i), successor_codebook[c] >

with `previous` the token drafted at row i - 1 (the last known token for row 1).

This stage keeps the drafter of `--init` as it is (frozen) and trains only the
selector, on the same target-generated text as `training.dflash` (its cache in
training/.cache/dflash). Teacher forcing is exact here: a greedy round keeps
row i only if rows 1..i-1 were the target's tokens, so `previous` is the
target's token wherever it matters. Loss: cross-entropy over each row's
candidates on the target's greedy token (rows whose token is not a candidate
are left out: no score reaches it), rows weighted exp(-(i - 1) / decay).

The drafter is written as a `DFlash2DraftModel`: the drafter's own weights,
convolutions of one tap that pass their input through unchanged
(`conv_kernel_size` 1, one group, `base_kernel` 1, `kernel_projection` 0),
and the selector. With a zero `hidden_projection` it drafts exactly what the
DFlash drafter drafts (tests/test_training_dflash_selector.py).

Held-out: training.dflash's deployment-shaped check (128 validation prompts of
64 tokens continued for 64), walked round by round as greedy decoding walks it,
with and without the selector; metrics.json keeps both and the run's settings,
and the drafter's own record under `previous_stage`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from training.dflash import (EVAL_BLOCKS, REPO, SEED, add_sampled_arguments, block_rows,
                             blocks_at, load_target, prepared, rounds_mean, sampled_flags,
                             training_data)

DEFAULT_INIT = REPO / "mlx_spec" / "default_models" / "dflash"
TRAIN_ROWS = 7  # block rows 1..7 per anchor in training (causal: the start of any block)
HELD_OUT_SEQUENCES = 128  # training.dflash's deployment-shaped check


def arguments(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", default=str(DEFAULT_INIT),
                    help="the trained DFlash drafter (DFlashDraftModel or DFlash2DraftModel)")
    ap.add_argument("--out", default=str(DEFAULT_INIT))
    ap.add_argument("--sequences", type=int, default=8192, help="target-generated sequences")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--generate-tokens", type=int, default=96)
    ap.add_argument("--anchors", type=int, default=40, help="blocks per sequence")
    ap.add_argument("--top-k", type=int, default=16, help="selector_top_k: candidates per row")
    ap.add_argument("--rank", type=int, default=64, help="selector_rank")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=1024, help="block rows per step")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--decay", type=float, default=3.0, help="row weights exp(-(i-1)/decay)")
    ap.add_argument("--kl", type=float, default=0.0,
                    help="weight of KL(target || selector) over each row's candidates")
    ap.add_argument("--seed", type=int, default=777, help="the data's seed (training.dflash's)")
    add_sampled_arguments(ap)
    ap.add_argument("--evaluate", default=None, metavar="DIR",
                    help="only measure the DFlash2 drafter in DIR on the held-out text")
    return ap.parse_args(argv)


class Selector(nn.Module):
    """The selector's weights, named as `CandidateSelector` stores them."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.predecessor_codebook = mx.random.normal((vocab, rank)) * 0.1
        self.successor_codebook = mx.random.normal((vocab, rank)) * 0.1
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.hidden_projection.weight = mx.zeros_like(self.hidden_projection.weight)


def scores(selector, candidates, unary, hidden, previous):
    """The scores (..., K) of candidates (..., K) with logits `unary`, the rows' hidden
    (..., H) and the tokens before them (...), by a `Selector` or the `CandidateSelector` of a
    loaded DFlash2 drafter (the same weights): mlx-spec's own `selector_scores`."""
    from mlx_spec.dflash.dflash2 import selector_scores

    return selector_scores(selector, candidates, unary, selector.hidden_projection(hidden),
                           previous)


def block_features(drafter, target, sequences, features, anchors, rows, top_k, theta, mask_id,
                   batch=16, finals=None):
    """Per anchor and block row 1..rows: the drafter's candidates and their logits (.., K),
    its normed rows (.., H, float16), the token before each row and the label; with the
    target's final hidden states `finals` (n, T, H), also the target's log-probabilities of
    the candidates at each row ("target", .., K)."""
    out = {k: [] for k in ("candidates", "unary", "hidden", "previous", "labels")}
    if finals is not None:
        out["target"] = []
    embed, head = target.model.embed_tokens, target.lm_head
    for start in range(0, len(sequences), batch):
        index = np.arange(start, min(start + batch, len(sequences)))
        blocks, labels = blocks_at(sequences[index], anchors[index], rows + 1, mask_id)
        hidden = block_rows(drafter, embed, mx.array(features[index]).astype(mx.float32),
                            mx.array(blocks), mx.array(anchors[index]), theta, True)
        hidden = hidden.reshape(*labels.shape, -1)[:, :, 1:]
        logits = head(hidden)
        candidates = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        mx.eval(candidates, unary, hidden)
        out["candidates"].append(np.array(candidates).reshape(-1, rows, top_k))
        out["unary"].append(np.array(unary).reshape(-1, rows, top_k))
        out["hidden"].append(np.array(hidden.astype(mx.float16)).reshape(-1, rows,
                                                                          hidden.shape[-1]))
        out["previous"].append(labels[..., :-1].reshape(-1, rows))
        out["labels"].append(labels[..., 1:].reshape(-1, rows))
        if finals is not None:  # row i's token follows position c + i - 1
            before = anchors[index][..., None] + np.arange(rows)  # (b, M, rows)
            final = np.take_along_axis(finals[index], before.reshape(len(index), -1)[..., None],
                                       axis=1)
            log_p = nn.log_softmax(head(mx.array(final).astype(mx.float32)), axis=-1)
            log_p = mx.take_along_axis(log_p.reshape(*candidates.shape[:-1], -1), candidates,
                                       axis=-1)
            out["target"].append(np.array(log_p).reshape(-1, rows, top_k))
    return {k: np.concatenate(v) for k, v in out.items()}


def walk(selector, data, batch=4096) -> np.ndarray:
    """Greedy drafts (n, rows) walked left to right from each block's first token, as
    `CandidateSelector.walk` drafts them (`selector`: a `Selector` or a loaded drafter's
    `CandidateSelector`; None: the plain argmax of each row)."""
    drafts = []
    for start in range(0, len(data["candidates"]), batch):
        part = {k: mx.array(v[start:start + batch]) for k, v in data.items()}
        candidates, unary = part["candidates"], part["unary"]
        if selector is None:
            best = mx.argmax(unary, axis=-1)[..., None]
            drafts.append(np.array(mx.take_along_axis(candidates, best, -1)[..., 0]))
            continue
        hidden = part["hidden"].astype(mx.float32)
        previous, chosen = part["previous"][:, 0], []
        for i in range(candidates.shape[1]):
            best = mx.argmax(scores(selector, candidates[:, i], unary[:, i], hidden[:, i],
                                    previous), axis=-1)[:, None]
            previous = mx.take_along_axis(candidates[:, i], best, -1)[:, 0]
            chosen.append(previous)
        drafts.append(np.array(mx.stack(chosen, axis=1)))
    return np.concatenate(drafts)


def acceptance(drafts, labels, sequences: int) -> dict:
    """Per round at blocks 4 / 8 / 16 as greedy decoding walks the text, over every anchor,
    and each row's agreement with the target, from drafts and labels (sequences x anchors,
    rows)."""
    hits = drafts == labels
    leading = np.cumprod(hits, axis=1).sum(axis=1)
    blocks = [b for b in EVAL_BLOCKS if b - 1 <= hits.shape[1]]
    return {"per_round": {str(b): round(rounds_mean(leading.reshape(sequences, -1), b - 1), 3)
                          for b in blocks},
            "accepted": {str(b): round(float(np.minimum(leading, b - 1).mean()), 3)
                         for b in blocks},
            "row_agreement": [round(float(v), 3) for v in hits.mean(axis=0)]}


def dflash2_config(config: dict, selector: Selector, top_k: int) -> dict:
    """The drafter's config as a DFlash2DraftModel with pass-through convolutions."""
    out = json.loads(json.dumps(config))
    out["architectures"] = ["DFlash2DraftModel"]
    out["dflash_config"].update(conv_kernel_size=1, conv_group_size=config["hidden_size"],
                                selector_rank=selector.hidden_projection.weight.shape[0],
                                selector_top_k=top_k)
    return out


def dflash2_weights(drafter, selector: Selector) -> dict:
    """The drafter's weights, one-tap pass-through convolutions and the selector's."""
    weights = dict(tree_flatten(drafter.parameters()))
    weights = {k: v for k, v in weights.items()  # (an --init DFlash2's own are replaced)
               if "_conv." not in k and not k.startswith("candidate_selector.")}
    hidden = drafter.fc.weight.shape[0]
    for i in range(len(drafter.layers)):
        for conv in ("attention_conv", "mlp_conv"):
            weights[f"layers.{i}.{conv}.base_kernel"] = mx.ones((2, 1, hidden))
            weights[f"layers.{i}.{conv}.kernel_projection.weight"] = mx.zeros((2, hidden))
    for name, value in tree_flatten(selector.parameters()):
        weights[f"candidate_selector.{name}"] = value
    return weights


def passes_through(drafter) -> bool:
    """Whether every convolution of a DFlash2 drafter (if any) hands its input on unchanged."""
    return all(conv.passes_through() for conv in getattr(drafter, "convolutions", list)())


def save(out: Path, config: dict, weights: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(mx.float16) for k, v in weights.items()})


def train(selector, data, steps, batch, lr, weight_decay, decay, rng, say=print, kl=0.0):
    """AdamW on the selector alone; the loss curve (means of 100 steps). `kl` > 0 adds
    kl x KL(target || selector) over each row's candidates (data["target"]: the target's
    log-probabilities there, renormalized over them): at T > 0 a draft is drawn from
    softmax(score / T) over the candidates, which then should be the target's."""
    rows = data["candidates"].shape[1]
    weights = mx.array(np.exp(-np.arange(rows) / decay), mx.float32)
    names = ["candidates", "unary", "hidden", "previous", "labels"] + (["target"] if kl else [])

    def loss_fn(model, candidates, unary, hidden, previous, labels, target_log_p=None):
        scored = scores(model, candidates, unary, hidden, previous)
        target = candidates == labels[..., None]
        kept = weights * target.any(-1)  # no score reaches a label outside the candidates
        log_q = scored - mx.logsumexp(scored, axis=-1, keepdims=True)
        loss = (-(log_q * target).sum(-1) * kept).sum() / mx.maximum(kept.sum(), 1e-9)
        if target_log_p is not None:
            log_p = target_log_p - mx.logsumexp(target_log_p, axis=-1, keepdims=True)
            divergence = (mx.exp(log_p) * (log_p - log_q)).sum(-1)  # (.., rows)
            loss = loss + kl * (divergence * weights).sum() / (weights.sum() * len(divergence))
        return loss

    optimizer = optim.AdamW(learning_rate=lr, weight_decay=weight_decay)
    step_fn = nn.value_and_grad(selector, loss_fn)
    losses = []
    for step in range(steps):
        pick = rng.choice(len(data["candidates"]), min(batch, len(data["candidates"])),
                          replace=False)
        part = [mx.array(data[k][pick]) for k in names]
        part[2] = part[2].astype(mx.float32)
        loss, grads = step_fn(selector, *part)
        optimizer.update(selector, grads)
        mx.eval(selector.parameters(), optimizer.state, loss)
        losses.append(float(loss))
        if step % 250 == 0 or step == steps - 1:
            say(f"step {step}: loss {np.mean(losses[-100:]):.3f}")
    return [round(float(np.mean(losses[i:i + 100])), 4) for i in range(0, len(losses), 100)]


def held_out_rows(drafter, target, config, top_k, say):
    """The drafter's rows at every anchor of training.dflash's deployment-shaped held-out
    text (HELD_OUT_SEQUENCES validation prompts of 64 tokens continued for 64), whole
    blocks."""
    dflash = config["dflash_config"]
    block = config.get("block_size", dflash.get("block_size"))
    sequences, features, _ = prepared(target, "val", HELD_OUT_SEQUENCES, 64, 64,
                                      list(dflash["target_layer_ids"]), SEED + 2, say)
    anchors = np.broadcast_to(np.arange(64, sequences.shape[1] - block + 1),
                              (len(sequences), sequences.shape[1] - block + 1 - 64))
    return block_features(drafter, target, sequences, features, anchors, block - 1, top_k,
                          config["rope_theta"], dflash["mask_token_id"])


def evaluate(directory, say=print) -> dict:
    """A written drafter's held-out acceptance, with its selector and without (each row's
    argmax): bench/results/dflash-heldout-<directory name>.json."""
    from mlx_spec.dflash import load_dflash

    drafter = load_dflash(str(directory))
    drafter.set_dtype(mx.float32)
    config = json.loads((Path(directory) / "config.json").read_text())
    if drafter.dflash_config.dflash2 is None or not passes_through(drafter):
        raise SystemExit(f"{directory} is not a DFlash2 drafter with pass-through convolutions "
                         "(what this stage writes); `python -m training.dflash --evaluate` "
                         "measures a DFlashDraftModel.")
    data = held_out_rows(drafter, load_target(), config,
                         drafter.dflash_config.dflash2.selector_top_k, say)
    result = {"command": f"python -m training.dflash_selector --evaluate {directory}",
              "drafter": str(directory),
              **acceptance(walk(drafter.candidate_selector, data), data["labels"],
                           HELD_OUT_SEQUENCES),
              "without_selector": acceptance(walk(None, data), data["labels"],
                                             HELD_OUT_SEQUENCES)}
    out = REPO / "bench" / "results" / f"dflash-heldout-{Path(directory).resolve().name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    say(f"{directory}: held-out accepted drafts per round {result['per_round']} with its "
        f"selector, {result['without_selector']['per_round']} without; wrote {out}")
    return result


def main(argv=None):
    args = arguments(argv)
    if args.evaluate:
        return evaluate(args.evaluate)
    rng = np.random.default_rng(args.seed)
    mx.random.seed(args.seed)
    start = time.perf_counter()

    def say(message):
        print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)

    from mlx_spec.dflash import load_dflash

    init = Path(args.init)
    config = json.loads((init / "config.json").read_text())
    previous = json.loads((init / "metrics.json").read_text()) \
        if (init / "metrics.json").exists() else None
    if not config.get("is_causal"):
        raise SystemExit(f"{init} is not causal inside its block (is_causal): its rows depend "
                         "on the rows after them, which this stage's training blocks cut off.")
    drafter = load_dflash(str(init))
    drafter.set_dtype(mx.float32)
    if not passes_through(drafter):
        raise SystemExit(f"{init} is a DFlash2 drafter whose convolutions change their input: "
                         "this stage computes the drafter's rows without them.")
    drafter.freeze()
    target = load_target()
    dflash = config["dflash_config"]
    taps, mask_id, theta = list(dflash["target_layer_ids"]), dflash["mask_token_id"], \
        config["rope_theta"]

    sequences, features, finals = training_data(target, args, taps, say)
    T = sequences.shape[1]
    anchors = np.stack([np.sort(rng.choice(np.arange(args.prompt_tokens, T - TRAIN_ROWS),
                                           args.anchors, replace=False))
                        for _ in range(len(sequences))])
    say(f"the drafter's rows at {anchors.size:,} training blocks")
    data = block_features(drafter, target, sequences, features, anchors, TRAIN_ROWS,
                          args.top_k, theta, mask_id, finals=finals if args.kl else None)
    del features, finals
    held_out = held_out_rows(drafter, target, config, args.top_k, say)

    selector = Selector(config["hidden_size"], config["vocab_size"], args.rank)
    without = acceptance(walk(None, held_out), held_out["labels"], HELD_OUT_SEQUENCES)
    say(f"held out, the drafter alone: per round {without['per_round']}")
    say(f"training the selector: {sum(v.size for _, v in tree_flatten(selector.parameters())):,}"
        f" parameters, {args.steps} steps")
    curve = train(selector, data, args.steps, args.batch, args.lr, args.weight_decay,
                  args.decay, rng, say, kl=args.kl)
    with_selector = acceptance(walk(selector, held_out), held_out["labels"],
                               HELD_OUT_SEQUENCES)
    say(f"held out, with the selector: per round {with_selector['per_round']} "
        f"(over anchors {with_selector['accepted']})")

    out = Path(args.out)
    save(out, dflash2_config(config, selector, args.top_k), dflash2_weights(drafter, selector))
    metrics = {
        "reproduce": ("OPENBLAS_NUM_THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/"
                      "openblas-pthread/libopenblas.so.0 python -m training.dflash_selector "
                      f"--init DFLASH_DIR --sequences {args.sequences} --anchors {args.anchors} "
                      f"--top-k {args.top_k} --rank {args.rank} --steps {args.steps} "
                      f"--batch {args.batch} --lr {args.lr} --weight-decay {args.weight_decay} "
                      f"--decay {args.decay} --kl {args.kl} --seed {args.seed}"
                      + sampled_flags(args)),
        "seconds": round(time.perf_counter() - start, 1),
        "stage": "candidate selector (DFlash2) on the frozen drafter of previous_stage",
        "selector_top_k": args.top_k, "selector_rank": args.rank,
        "training_blocks": int(anchors.size), "loss_curve": curve,
        "held_out_deployment": with_selector,
        "held_out_deployment_without_selector": without}
    if previous is not None:
        metrics["previous_stage"] = previous
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    say(f"wrote {out}")
    return metrics


if __name__ == "__main__":
    main()
