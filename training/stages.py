"""Training stages: the LR schedule, one resumable seeded stage, and the target's
own continuations that the distillation stages train on (cached on disk)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np

from .data import get_batch, make_prompts


def lr_at(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def kl_and_argmax_ce(tlogp, logits):
    """(KL(teacher || model), CE(teacher's argmax)) averaged over positions; tlogp: teacher logprobs."""
    import torch.nn.functional as F

    logq = F.log_softmax(logits, dim=-1)
    kl = (tlogp.exp() * (tlogp - logq)).sum(-1).mean()
    return kl, F.nll_loss(logq.reshape(-1, logq.size(-1)), tlogp.argmax(-1).reshape(-1))


def distill_loss(model, x, y, teacher=None, kl_weight=0.0, hard_weight=0.0):
    """(loss, CE(next token)): with a teacher, kl_weight * KL(teacher || model)
    + hard_weight * CE(teacher's argmax) + (1 - kl_weight - hard_weight) * CE(next token)."""
    import torch
    import torch.nn.functional as F

    logits = model(x)
    ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    loss = ce
    if teacher is not None and kl_weight + hard_weight > 0:
        with torch.no_grad():
            tlogp = F.log_softmax(teacher(x), dim=-1)
        kl, hard = kl_and_argmax_ce(tlogp, logits)
        loss = kl_weight * kl + (1 - kl_weight - hard_weight) * ce
        if hard_weight:  # only the greedy stages train on the teacher's argmax
            loss = loss + hard_weight * hard
    return loss, ce


def mtp_loss(head, target, x, kl_weight=0.5, depth2_weight=0.5):
    """(loss, CE of depth 1 against the text) of the MTP head on windows ``x`` (B, T) of the
    frozen target's text. Depth d at pair i predicts x_{i+d+1}, the target's distribution at
    position i + d; each depth's loss is kl_weight * KL(target || head) + the rest x CE(target's
    argmax), depth 2 weighted by ``depth2_weight`` (it feeds the head its own output, as drafting does)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        h = target.hidden(x)  # (B, T, H), after the final norm
        tlogp = F.log_softmax(target.lm_head(h), dim=-1)  # (B, T, V): position t predicts x_{t+1}
        e = target.model.embed_tokens(x)  # (B, T, H)
        e1 = e[:, 1:].clone()
        e1[:, 0] = 0  # the first pair has no embedding input (vLLM's deepseek_mtp.py)
    cache = [None]
    g1 = head(e1, h[:, :-1], 0, cache)  # (B, T-1, H): pair i = (h_i, x_{i+1})
    logits1 = target.lm_head(g1)  # predicts x_{i+2}
    kl1, hard1 = kl_and_argmax_ce(tlogp[:, 1:], logits1)
    loss = kl_weight * kl1 + (1 - kl_weight) * hard1
    if depth2_weight:
        k1, v1 = cache[0]  # (B, h, T-1, hd): keys of the true pairs
        g2 = head.chained(e[:, 2:], g1[:, :-1], k1[:, :, :-1], v1[:, :, :-1])  # (B, T-2, H)
        kl2, hard2 = kl_and_argmax_ce(tlogp[:, 2:], target.lm_head(g2))  # predicts x_{i+3}
        loss = loss + depth2_weight * (kl_weight * kl2 + (1 - kl_weight) * hard2)
    ce = F.cross_entropy(logits1[:, :-1].reshape(-1, logits1.size(-1)), x[:, 2:].reshape(-1))  # for the log
    return loss, ce


def train_stage(name, model, data, args, ckpt_path, minutes, steps, peak_lr, teacher=None, kl_weight=0.0,
                hard_weight=0.0, lr_floor=0.1, ema_decay=0.0, loss_fn=None):
    """Train ``model`` on ``data``; resumable from ``ckpt_path``.  The loss is
    ``distill_loss`` (with ``teacher``, ``kl_weight``, ``hard_weight``), or
    ``loss_fn(model, x, y) -> (loss, ce)``.
    The LR warms up, then decays by cosine to ``lr_floor`` x peak (1.0 = constant).
    With ``ema_decay`` the model ends as the moving average of its weights."""
    import torch

    if loss_fn is None:
        def loss_fn(model, x, y):
            return distill_loss(model, x, y, teacher, kl_weight, hard_weight)

    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "total": None, "tokens": 0, "seconds": 0.0, "log": []}
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()} if ema_decay else None
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        ema = ck.get("ema", ema)
        print(f"[{name}] resumed from {ckpt_path} at step {state['step']}/{state['total']}", flush=True)
    if steps:
        state["total"] = steps  # explicit steps override (also extends a finished run)

    def step_fn(step):
        x, y = get_batch(data, step, args.seed, args.batch, args.seq)
        loss, ce = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if ema is not None:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    ema[k].mul_(ema_decay).add_(v, alpha=1 - ema_decay)
        return loss.item(), ce.item()

    def save():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    **({"ema": ema} if ema is not None else {})}, tmp)
        os.replace(tmp, ckpt_path)

    if state["total"] is None:
        # Timing run to turn the minute budget into a fixed number of steps.
        # Its updates are real training steps 0..n-1 (same batches, same LR schedule
        # shape is fixed afterwards), so they are kept.
        n_probe, t0 = 8, None
        for s in range(n_probe):
            if s == 3:
                t0 = time.time()
            for g in opt.param_groups:
                g["lr"] = lr_at(s, 10**9, peak_lr, args.warmup)  # warmup part only
            step_fn(s)
        dt = (time.time() - t0) / (n_probe - 3)
        state["total"] = max(n_probe + 1, int(minutes * 60 / dt))
        state["step"] = n_probe
        state["tokens"] = n_probe * args.batch * args.seq
        print(f"[{name}] {dt:.2f}s/step -> {state['total']} steps for {minutes} min", flush=True)

    total = state["total"]
    t_start, last_save = time.time(), time.time()
    sec0, tok_run, loss_ema = state["seconds"], 0, None
    while state["step"] < total:
        s = state["step"]
        lr = lr_at(s, total, peak_lr, args.warmup, lr_floor)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, ce = step_fn(s)
        state["step"] += 1
        state["tokens"] += args.batch * args.seq
        tok_run += args.batch * args.seq
        loss_ema = ce if loss_ema is None else 0.95 * loss_ema + 0.05 * ce
        el = time.time() - t_start
        state["seconds"] = sec0 + el
        if state["step"] % args.log_every == 0 or state["step"] == total:
            tps = tok_run / el
            eta = (total - state["step"]) * (el / (tok_run / (args.batch * args.seq)))
            print(f"[{name}] step {state['step']}/{total} loss {loss:.3f} ce_ema {loss_ema:.3f} "
                  f"lr {lr:.2e} {tps:.0f} tok/s tokens {state['tokens']/1e6:.2f}M ETA {eta/60:.1f} min", flush=True)
            state["log"].append([state["step"], round(loss_ema, 4)])
        if time.time() - last_save > args.ckpt_every:
            save()
            last_save = time.time()
    if tok_run:  # a finished stage that was only resumed is left as it is on disk
        save()
    if ema is not None:
        model.load_state_dict(ema)
    return state


def target_generate(target, prompts, gen, temperature, seed, batch=128):
    """Continue each prompt row (np [N, P]) by ``gen`` tokens sampled from ``target``
    (greedy when temperature is 0), with a KV cache.  Returns np [N, P + gen]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.from_numpy(prompts[i : i + batch].astype(np.int64))
            caches, out, offset = [[None] for _ in target.model.layers], [ids], 0
            nxt = ids
            for _ in range(gen):
                logits = target(nxt, caches, offset)[:, -1].float()
                offset += nxt.shape[1]
                if temperature == 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
                out.append(nxt)
            rows.append(torch.cat(out, 1).numpy())
            print(f"[kd-data] {i + len(ids)}/{len(prompts)} rows (T={temperature})", flush=True)
    return np.concatenate(rows)


def kd_stream(target, data, rows, plen, gen, temperatures, seed, eos_id, path: Path):
    """Target continuations of ``rows`` training-split prompts, one temperature per
    equal share of the rows, flattened into an EOS-separated token stream; cached in ``path``."""
    if path.exists():
        return np.load(path)["ids"]
    prompts = np.stack(make_prompts(data, rows, plen, seed, eos_id, gen))
    parts = []
    for j, temp in enumerate(temperatures):
        share = prompts[j :: len(temperatures)]
        gen_rows = target_generate(target, share, gen, temp, seed + j)
        parts.append(np.concatenate([gen_rows, np.full((len(gen_rows), 1), eos_id)], 1).reshape(-1))
    ids = np.concatenate(parts).astype(np.uint16)
    np.savez(path, ids=ids)
    return ids
