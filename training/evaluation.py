"""Held-out loss, exact speculative-decoding simulation, and the MLX check that
mlx_lm reproduces the PyTorch logits of an exported model."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def eval_loss(model, val, seq, max_windows=256):
    import torch
    import torch.nn.functional as F

    n = (len(val) - 1) // seq
    idx = np.linspace(0, n - 1, num=min(n, max_windows)).astype(int)
    tot, cnt = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(idx), 16):
            rows = [val[j * seq : j * seq + seq + 1].astype(np.int64) for j in idx[i : i + 16]]
            x = torch.from_numpy(np.stack(rows))
            logits = model(x[:, :-1])
            tot += F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum").item()
            cnt += x[:, 1:].numel()
    return tot / cnt


def model_steps(draft, ctx):
    """A draft model's logits for each next draft token; ``send`` it the token chosen."""
    import torch

    cur = ctx
    while True:
        token = yield draft(cur)[0, -1].float()
        cur = torch.cat([cur, torch.tensor([[token]])], 1)


def spec_simulate(target, draft, prompts, k, gen, temperature, seed):
    """Simulate speculative decoding (no KV cache: full recompute, exact).
    ``draft``: a model, or an object whose ``steps(ctx)`` is a generator like ``model_steps``.
    Returns accepted/drafted and mean accepted per round."""
    import torch

    g = torch.Generator().manual_seed(seed)
    acc_tot, draft_tot, rounds, rejections = 0, 0, 0, 0
    with torch.inference_mode():
        for p in prompts:
            ctx = torch.from_numpy(p)[None]
            produced = 0
            while produced < gen:
                kk = k
                cur = ctx
                qs, toks = [], []
                steps = draft.steps(ctx) if hasattr(draft, "steps") else model_steps(draft, ctx)
                for i in range(kk):
                    lg = next(steps) if i == 0 else steps.send(toks[-1])
                    if temperature == 0:
                        t = int(lg.argmax())
                        q = None
                    else:
                        q = torch.softmax(lg / temperature, -1)
                        t = int(torch.multinomial(q, 1, generator=g))
                    qs.append(q)
                    toks.append(t)
                    cur = torch.cat([cur, torch.tensor([[t]])], 1)
                tl = target(cur)[0, -kk - 1 :].float()  # kk+1 positions
                n_acc = 0
                new = None
                for j in range(kk):
                    if temperature == 0:
                        tt = int(tl[j].argmax())
                        if tt == toks[j]:
                            n_acc += 1
                            continue
                        new = tt
                        break
                    pj = torch.softmax(tl[j] / temperature, -1)
                    x = toks[j]
                    if torch.rand(1, generator=g).item() < min(1.0, (pj[x] / qs[j][x]).item()):
                        n_acc += 1
                        continue
                    resid = torch.clamp(pj - qs[j], min=0)
                    resid = resid / resid.sum() if resid.sum() > 0 else pj
                    new = int(torch.multinomial(resid, 1, generator=g))
                    break
                if new is None:
                    if temperature == 0:
                        new = int(tl[kk].argmax())
                    else:
                        new = int(torch.multinomial(torch.softmax(tl[kk] / temperature, -1), 1, generator=g))
                acc_tot += n_acc
                draft_tot += kk
                rejections += n_acc < kk
                rounds += 1
                ctx = torch.cat([ctx, torch.tensor([toks[:n_acc] + [new]])], 1)
                produced += n_acc + 1
    return {
        "acceptance_rate": round(acc_tot / draft_tot, 4),
        # per-token acceptance probability (Leviathan et al.'s alpha), i.i.d. MLE
        "alpha": round(acc_tot / (acc_tot + rejections), 4),
        "mean_accepted_per_round": round(acc_tot / rounds, 4),
        "tokens_per_round": round((acc_tot + rounds) / rounds, 4),
        "rounds": rounds,
    }


def mlx_check(model, path: Path, ids: np.ndarray):
    """Load with mlx_lm and compare logits against PyTorch (fp32 and fp16-rounded weights)."""
    import copy

    import mlx.core as mx
    import mlx_lm
    import torch

    m, t = mlx_lm.load(str(path))
    ml = np.array(m(mx.array(ids[None].astype(np.int32))).astype(mx.float32))[0]
    with torch.inference_mode():
        tl32 = model(torch.from_numpy(ids[None].astype(np.int64)))[0].numpy()
        m16 = copy.deepcopy(model)
        for p in m16.parameters():
            p.data = p.data.half().float()
        tl16 = m16(torch.from_numpy(ids[None].astype(np.int64)))[0].numpy()
    return {
        "max_abs_diff_vs_fp32": float(np.abs(ml - tl32).max()),
        "max_abs_diff_vs_fp16_weights": float(np.abs(ml - tl16).max()),
        "argmax_agreement": float((ml.argmax(-1) == tl32.argmax(-1)).mean()),
        "logit_scale": float(np.abs(tl32).max()),
    }, (m, t)
