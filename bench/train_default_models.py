#!/usr/bin/env python3
"""Train the small target/draft llama pair shipped in ``mlx_spec/default_models``.

Training-only script: needs the ``train`` extra (``pip install torch tokenizers``)
plus ``mlx-lm`` for the export check.  The mlx_spec runtime never imports torch.

Pipeline (every stage is seeded; the run is resumable from checkpoints kept in
``--work-dir``, which defaults to the git-ignored ``bench/.cache/``):

1. Data: Python source files of the running interpreter's standard library
   (``sysconfig.get_paths()['stdlib']``), fixed selection (see ``select_files``),
   split by a SHA-1 hash of the *top-level module/package name* so that whole
   modules (packages) are held out for validation (~5%).
2. Tokenizer: byte-level BPE (Hugging Face ``tokenizers``), vocab 4096,
   ``<|endoftext|>`` (id 0) is EOS/BOS and separates files.
3. Target: minimal Llama in PyTorch (HF LlamaForCausalLM parameter names),
   AdamW, warmup + cosine decay.
4. Draft(s): distilled from the target (KL + a little CE) and/or trained with
   plain CE; the variant with the best greedy acceptance on *training-split*
   prompts is exported.
5. Export to HF layout (float16 safetensors), verify that mlx_lm reproduces the
   PyTorch logits, measure held-out loss and speculative-decoding acceptance,
   write metrics.json and README.md.

The number of optimisation steps is fixed at the start of a stage: either
``--target-steps/--draft-steps`` or derived from the ``--*-minutes`` budget via
a short timing run.  The steps actually used are recorded in metrics.json, so an
exact reproduction passes them explicitly.

Reproduce the shipped models:
    nice -n 10 python bench/train_default_models.py --target-steps N --draft-steps M
(N, M as recorded in mlx_spec/default_models/metrics.json["training"]).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "mlx_spec" / "default_models"
EOS = "<|endoftext|>"

EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages",
    "__pycache__", "lib2to3", "ensurepip", "venv", "pydoc_data",
}
MAX_FILE_BYTES = 100_000
SAMPLE_HEADERS = ("def fibonacci(n):", "def is_prime(n):", "def read_lines(path):",
                  "def add(a, b):", "def flatten(items):", "class Stack:")
VAL_PERCENT = 5


# --------------------------------------------------------------------------- data
def select_files(root: Path) -> list[Path]:
    """Sorted *.py files under stdlib root, minus tests/idle/demo/site-packages,
    files named test_*.py and files larger than MAX_FILE_BYTES."""
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        parts = rel.parts
        if any(d in EXCLUDED_DIRS or d.startswith("test") for d in parts[:-1]):
            continue
        if parts[-1].startswith("test_") or parts[-1] == "__phello__.py":
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    return out


def module_key(rel: Path) -> str:
    """Top-level module or package name: whole packages go to the same split."""
    first = rel.parts[0]
    return first[:-3] if first.endswith(".py") else first


def is_val(rel: Path) -> bool:
    h = int(hashlib.sha1(module_key(rel).encode()).hexdigest()[:8], 16)
    return h % 100 < VAL_PERCENT


def select_test_files(root: Path, val_modules: list[str]) -> list[Path]:
    """Sorted *.py files of the stdlib's own test suite (``test/``), at most
    MAX_FILE_BYTES each, minus tests of held-out modules (``test_<val module>*``
    files and directories), so no validation module leaks into training."""
    out = []
    for p in sorted((root / "test").rglob("*.py")):
        rel = p.relative_to(root / "test")
        if "__pycache__" in rel.parts or p.stat().st_size > MAX_FILE_BYTES:
            continue
        names = [n[:-3] if n.endswith(".py") else n for n in rel.parts]
        if any(n.startswith("test_") and n[5:].startswith(m) for n in names for m in val_modules):
            continue
        out.append(p)
    return out


def load_test_corpus(root: Path, val_modules: list[str]):
    docs = []
    for p in select_test_files(root, val_modules):
        try:
            docs.append((str(p.relative_to(root)), p.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def load_corpus():
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for p in select_files(root):
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        rel = p.relative_to(root)
        (val if is_val(rel) else train).append((str(rel), text))
    return root, train, val


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts, eos_id):
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


# -------------------------------------------------------------------------- model
@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads


def build_model(cfg: LlamaConfig):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class RMSNorm(nn.Module):
        def __init__(self, d, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d, h = cfg.hidden_size, cfg.num_attention_heads
            self.h, self.hd = h, cfg.head_dim
            self.q_proj = nn.Linear(d, h * self.hd, bias=False)
            self.k_proj = nn.Linear(d, h * self.hd, bias=False)
            self.v_proj = nn.Linear(d, h * self.hd, bias=False)
            self.o_proj = nn.Linear(h * self.hd, d, bias=False)

        def forward(self, x, cos, sin, cache=None):
            """``cache``: None (training), or a one-item list holding this layer's (k, v) so
            far (None before the first call); it is extended in place."""
            B, T, _ = x.shape
            q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            first = cache is None or cache[0] is None
            if cache is not None:
                if not first:
                    k, v = torch.cat([cache[0][0], k], 2), torch.cat([cache[0][1], v], 2)
                cache[0] = (k, v)
            # later calls feed one token, which sees every cached position
            y = F.scaled_dot_product_attention(q, k, v, is_causal=first)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            d, f = cfg.hidden_size, cfg.intermediate_size
            self.gate_proj = nn.Linear(d, f, bias=False)
            self.up_proj = nn.Linear(d, f, bias=False)
            self.down_proj = nn.Linear(f, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention()
            self.mlp = MLP()
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

        def forward(self, x, cos, sin, cache=None):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(Block() for _ in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    class LlamaForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)
            self.apply(self._init)
            std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
            for blk in self.model.layers:
                nn.init.normal_(blk.self_attn.o_proj.weight, std=std)
                nn.init.normal_(blk.mlp.down_proj.weight, std=std)

        @staticmethod
        def _init(m):
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

        def forward(self, ids, caches=None, offset=0):
            """Logits of every position.  ``caches`` (one [None] list per layer, filled in
            place) and ``offset`` (tokens already cached) give KV-cached decoding."""
            T = ids.shape[1]
            t = torch.arange(offset, offset + T, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[None, None], emb.sin()[None, None]
            x = self.model.embed_tokens(ids)
            for i, blk in enumerate(self.model.layers):
                x = blk(x, cos, sin, None if caches is None else caches[i])
            return self.lm_head(self.model.norm(x))

    return LlamaForCausalLM()


def n_params(model):
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------- training
@dataclass
class KDMix:
    """Batches whose rows are ``kd_fraction`` target-generated text, the rest ``real`` data."""

    real: object
    generated: np.ndarray
    kd_fraction: float


def get_batch(data, step, seed, batch, seq):
    """``data`` is a token array, or a (core, extended, from_step) triple: batches of
    steps >= from_step are drawn from the extended array (curriculum, see --tests-from-step)."""
    import torch

    if isinstance(data, KDMix):
        n_kd = round(batch * data.kd_fraction)
        x2, y2 = get_batch(data.generated, step, seed + 1, n_kd, seq)
        if n_kd == batch:
            return x2, y2
        x1, y1 = get_batch(data.real, step, seed, batch - n_kd, seq)
        return torch.cat([x1, x2]), torch.cat([y1, y2])
    if isinstance(data, tuple):
        core, extended, from_step = data
        data = extended if step >= from_step else core

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    x = torch.stack([torch.from_numpy(data[i : i + seq + 1].astype(np.int64)) for i in ix.tolist()])
    return x[:, :-1], x[:, 1:]


def lr_at(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_stage(name, model, data, args, ckpt_path, minutes, steps, peak_lr, teacher=None, kl_weight=0.0,
                hard_weight=0.0, lr_floor=0.1, ema_decay=0.0):
    """Train ``model`` on ``data``; resumable from ``ckpt_path``.  With a teacher,
    loss = kl_weight * KL(teacher || model) + hard_weight * CE(teacher's argmax)
           + (1 - kl_weight - hard_weight) * CE(next token).
    The LR warms up, then decays by cosine to ``lr_floor`` x peak (1.0 = constant).
    With ``ema_decay`` the model ends as the moving average of its weights."""
    import torch
    import torch.nn.functional as F

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
        logits = model(x)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss = ce
        if teacher is not None and kl_weight + hard_weight > 0:
            with torch.no_grad():
                tlogp = F.log_softmax(teacher(x), dim=-1)
            logq = F.log_softmax(logits, dim=-1)
            kl = (tlogp.exp() * (tlogp - logq)).sum(-1).mean()
            loss = kl_weight * kl + (1 - kl_weight - hard_weight) * ce
            if hard_weight:  # only the greedy stage trains on the teacher's argmax
                loss = loss + hard_weight * F.nll_loss(logq.view(-1, logq.size(-1)), tlogp.argmax(-1).view(-1))
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


# --------------------------------------------------------------------- evaluation
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


def make_prompts(data, n, plen, seed, eos_id, gen):
    """n deterministic prompts of plen tokens from ``data`` that do not straddle a file boundary."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        i = int(rng.integers(0, len(data) - plen - gen - 1))
        w = data[i : i + plen + gen]
        if (w == eos_id).any():
            continue
        out.append(data[i : i + plen].astype(np.int64))
    return out


def spec_simulate(target, draft, prompts, k, gen, temperature, seed):
    """Simulate speculative decoding (no KV cache: full recompute, exact).
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
                for _ in range(kk):
                    lg = draft(cur)[0, -1].float()
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


# ------------------------------------------------------------------------- export
def export_hf(model, cfg: LlamaConfig, tok_dir: Path, out: Path, eos_id: int):
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()
          if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / f, out / f)


def write_tokenizer_files(tok, tok_dir: Path):
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }, indent=2) + "\n")
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": EOS, "eos_token": EOS}, indent=2) + "\n")


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


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=str(REPO / "bench" / ".cache" / "default_models"))
    ap.add_argument("--out-dir", default=str(OUT_DIR))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--target-dim", type=int, default=256)
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--target-heads", type=int, default=4)
    ap.add_argument("--target-ffn", type=int, default=768)
    ap.add_argument("--draft-dim", type=int, default=88)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-heads", type=int, default=2)
    ap.add_argument("--draft-ffn", type=int, default=192)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--draft-tie", action="store_true",
                    help="share the draft's input embedding and output head (frees bytes for width)")
    ap.add_argument("--draft-lr", type=float, default=4e-3)
    ap.add_argument("--target-minutes", type=float, default=30)
    ap.add_argument("--draft-minutes", type=float, default=6, help="per draft variant")
    ap.add_argument("--target-steps", type=int, default=0, help="fixed step count (overrides minutes)")
    ap.add_argument("--draft-steps", type=int, default=0, help="fixed step count per variant")
    ap.add_argument("--draft-variants", default="ce,distill,ce+distill",
                    help="comma list of: ce (plain CE), distill (KL to target from scratch), "
                         "ce+distill (the finished ce draft fine-tuned with KL to the target), "
                         "kd (fine-tuned on the target's continuations), "
                         "greedy (fine-tuned towards the target's argmax on its greedy continuations), "
                         "polish (the greedy draft further on fresh greedy continuations, weights averaged)")
    ap.add_argument("--finetune-minutes", type=float, default=10, help="budget of the ce+distill fine-tune")
    ap.add_argument("--finetune-steps", type=int, default=0)
    ap.add_argument("--finetune-lr", type=float, default=1.5e-3)
    ap.add_argument("--kl-weight", type=float, default=0.8)
    ap.add_argument("--tests-from-step", type=int, default=-1,
                    help="target step from which batches also come from the stdlib test suite (test/*.py, "
                         "minus tests of held-out modules); -1: never")
    ap.add_argument("--draft-tests-from-step", type=int, default=-1,
                    help="the same for every draft stage")
    ap.add_argument("--kd-rows", type=int, default=8192,
                    help="target continuations generated for the 'kd' draft variant (sequence-level distillation)")
    ap.add_argument("--kd-gen", type=int, default=96, help="tokens generated per kd row (after a --prompt-len prompt)")
    ap.add_argument("--kd-temps", default="0,1.0", help="sampling temperatures of the kd rows, equal shares")
    ap.add_argument("--kd-fraction", type=float, default=0.5, help="share of each kd batch drawn from generated rows")
    ap.add_argument("--kd-minutes", type=float, default=15)
    ap.add_argument("--kd-steps", type=int, default=0)
    ap.add_argument("--kd-lr", type=float, default=1e-3)
    ap.add_argument("--greedy-rows", type=int, default=8192,
                    help="greedy variant: training-split prompts continued greedily by the target (--kd-gen tokens)")
    ap.add_argument("--greedy-fraction", type=float, default=1.0, help="share of each greedy batch from those rows")
    ap.add_argument("--greedy-kl", type=float, default=0.5,
                    help="greedy variant loss: this x KL(target || draft) + the rest x CE(target's argmax)")
    ap.add_argument("--greedy-minutes", type=float, default=15)
    ap.add_argument("--greedy-steps", type=int, default=0)
    ap.add_argument("--greedy-lr", type=float, default=5e-4)
    ap.add_argument("--polish-rows", type=int, default=12288,
                    help="polish variant: further training-split prompts continued greedily by the target")
    ap.add_argument("--polish-kl", type=float, default=0.5,
                    help="polish variant loss: this x KL(target || draft) + the rest x CE(target's argmax)")
    ap.add_argument("--polish-ema", type=float, default=0.995, help="polish variant: decay of the weights' moving average")
    ap.add_argument("--polish-minutes", type=float, default=5)
    ap.add_argument("--polish-steps", type=int, default=0)
    ap.add_argument("--polish-lr", type=float, default=3e-4, help="polish variant: constant LR after warmup")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="", help="free text recorded in metrics.json/README.md")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--ckpt-every", type=float, default=120, help="seconds")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    args = ap.parse_args()
    for name in ("kl_weight", "kd_fraction", "greedy_fraction", "greedy_kl", "polish_kl", "polish_ema"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            ap.error(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(args, name)}")

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    work, out = Path(args.work_dir), Path(args.out_dir)
    work.mkdir(parents=True, exist_ok=True)
    T0 = time.time()

    # ---- data + tokenizer
    stdlib, train_docs, val_docs = load_corpus()
    tok_dir = work / "tokenizer"
    data_path = work / "data.npz"
    if (tok_dir / "tokenizer.json").exists() and data_path.exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        d = np.load(data_path)
        train_ids, val_ids = d["train"], d["val"]
        print(f"loaded cached tokenizer/data from {work}", flush=True)
    else:
        print(f"training tokenizer on {len(train_docs)} train files ...", flush=True)
        tok = train_tokenizer([t for _, t in train_docs], args.vocab)
        write_tokenizer_files(tok, tok_dir)
        eos_id = tok.token_to_id(EOS)
        train_ids = encode_stream(tok, [t for _, t in train_docs], eos_id)
        val_ids = encode_stream(tok, [t for _, t in val_docs], eos_id)
        np.savez(data_path, train=train_ids, val=val_ids)
    eos_id = tok.token_to_id(EOS)
    assert eos_id == 0
    for _, text in val_docs[:20]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text, "round-trip failed"
    val_modules = sorted({module_key(Path(r)) for r, _ in val_docs})
    print(f"stdlib {stdlib}: {len(train_docs)} train files ({len(train_ids)/1e6:.2f}M tokens), "
          f"{len(val_docs)} val files ({len(val_ids)/1e6:.3f}M tokens); val modules: {', '.join(val_modules)}", flush=True)

    test_docs, test_ids = [], np.zeros(0, dtype=np.uint16)
    if args.tests_from_step >= 0 or args.draft_tests_from_step >= 0:
        test_docs = load_test_corpus(stdlib, val_modules)
        tests_path = work / "data_tests.npz"
        if tests_path.exists():
            test_ids = np.load(tests_path)["train"]
        else:
            test_ids = encode_stream(tok, [t for _, t in test_docs], eos_id)
            np.savez(tests_path, train=test_ids)
        print(f"stdlib test suite: {len(test_docs)} files ({len(test_ids)/1e6:.2f}M tokens)", flush=True)
    extended_ids = np.concatenate([train_ids, test_ids])

    def curriculum(from_step):
        return train_ids if from_step < 0 else (train_ids, extended_ids, from_step)

    # real text mixed into the kd and greedy batches: the drafts' data from their first step
    kd_real = curriculum(0 if args.draft_tests_from_step >= 0 else -1)

    # ---- target
    tcfg = LlamaConfig(args.vocab, args.target_dim, args.target_layers, args.target_heads, args.target_ffn)
    dcfg = LlamaConfig(args.vocab, args.draft_dim, args.draft_layers, args.draft_heads, args.draft_ffn,
                       tie_word_embeddings=args.draft_tie)
    # checkpoints of a tied draft are kept apart from the untied ones
    draft_tag = f"_tied{args.draft_dim}x{args.draft_layers}" if args.draft_tie else ""
    torch.manual_seed(args.seed)
    target = build_model(tcfg)
    torch.manual_seed(args.seed + 1)
    probe_draft = build_model(dcfg)
    tp, dp = n_params(target), n_params(probe_draft)
    print(f"target {tp/1e6:.3f}M params, draft {dp/1e6:.3f}M params, ratio {dp/tp:.4f}", flush=True)
    assert dp * 8 <= tp, "draft must be at most 1/8 of the target"

    target.train()
    tstate = train_stage("target", target, curriculum(args.tests_from_step), args, work / "target.ckpt", args.target_minutes,
                         args.target_steps, args.target_lr)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    # ---- drafts
    sel_prompts = make_prompts(train_ids, 16, args.prompt_len, args.seed + 7, eos_id, args.gen_len)
    variants = {}
    for v in [s.strip() for s in args.draft_variants.split(",") if s.strip()]:
        assert v in ("ce", "distill", "ce+distill", "kd", "greedy", "polish"), v
        torch.manual_seed(args.seed + 1)
        dm = build_model(dcfg)
        minutes, steps, lr = args.draft_minutes, args.draft_steps, args.draft_lr
        data, kl_weight, hard_weight = curriculum(args.draft_tests_from_step), args.kl_weight, 0.0
        lr_floor, ema_decay = 0.1, 0.0
        if v == "polish":
            # the greedy draft, further towards the target's argmax on fresh greedy continuations,
            # at a constant LR, keeping the moving average of the weights (it generalised better)
            assert "greedy" in variants, "list 'greedy' before 'polish' in --draft-variants"
            dm.load_state_dict(variants["greedy"]["model"].state_dict())
            minutes, steps, lr = args.polish_minutes, args.polish_steps, args.polish_lr
            kl_weight, hard_weight = args.polish_kl, 1.0 - args.polish_kl
            lr_floor, ema_decay = 1.0, args.polish_ema
            p_path = work / f"polish_{args.polish_rows}x{args.prompt_len}+{args.kd_gen}.npz"
            p_ids = kd_stream(target, train_ids, args.polish_rows, args.prompt_len, args.kd_gen, [0.0],
                              args.seed + 17, eos_id, p_path)
            print(f"[draft-polish] {len(p_ids)/1e6:.2f}M tokens of greedy target continuations ({p_path.name})",
                  flush=True)
            data = KDMix(kd_real, p_ids, 1.0)
        if v == "greedy":
            # greedy acceptance only needs the draft's argmax to be the target's: start from the
            # most distilled draft, then mix KL (keeps the sampling distribution) with CE on the
            # target's argmax, on the target's own greedy continuations
            start = next((s for s in ("kd", "ce+distill", "ce") if s in variants), None)
            assert start, "list 'ce' (and optionally 'ce+distill', 'kd') before 'greedy' in --draft-variants"
            dm.load_state_dict(variants[start]["model"].state_dict())
            minutes, steps, lr = args.greedy_minutes, args.greedy_steps, args.greedy_lr
            kl_weight, hard_weight = args.greedy_kl, 1.0 - args.greedy_kl
            g_path = work / f"greedy_{args.greedy_rows}x{args.prompt_len}+{args.kd_gen}.npz"
            g_ids = kd_stream(target, train_ids, args.greedy_rows, args.prompt_len, args.kd_gen, [0.0],
                              args.seed + 13, eos_id, g_path)
            print(f"[draft-greedy] {len(g_ids)/1e6:.2f}M tokens of greedy target continuations ({g_path.name}), "
                  f"starting from the {start} draft", flush=True)
            data = KDMix(kd_real, g_ids, args.greedy_fraction)
        if v == "kd":
            # sequence-level distillation: start from the ce+distill (else ce) draft, then pure
            # KL to the target on a mix of real text and the target's own continuations
            start = "ce+distill" if "ce+distill" in variants else "ce"
            assert start in variants, "list 'ce' (and optionally 'ce+distill') before 'kd' in --draft-variants"
            dm.load_state_dict(variants[start]["model"].state_dict())
            minutes, steps, lr, kl_weight = args.kd_minutes, args.kd_steps, args.kd_lr, 1.0
            temps = [float(t) for t in args.kd_temps.split(",")]
            kd_path = work / f"kd_{args.kd_rows}x{args.prompt_len}+{args.kd_gen}_{args.kd_temps}.npz"
            kd_ids = kd_stream(target, train_ids, args.kd_rows, args.prompt_len, args.kd_gen, temps,
                               args.seed + 11, eos_id, kd_path)
            print(f"[draft-kd] {len(kd_ids)/1e6:.2f}M tokens of target continuations ({kd_path.name})", flush=True)
            data = KDMix(kd_real, kd_ids, args.kd_fraction)
        if v == "ce+distill":
            # start from the finished CE draft, then distil from the target
            assert "ce" in variants, "list 'ce' before 'ce+distill' in --draft-variants"
            dm.load_state_dict(variants["ce"]["model"].state_dict())
            minutes, steps, lr = args.finetune_minutes, args.finetune_steps, args.finetune_lr
        distill = v in ("distill", "ce+distill", "kd", "greedy", "polish")
        dm.train()
        st = train_stage(f"draft-{v}", dm, data, args, work / f"draft_{v}{draft_tag}.ckpt", minutes,
                         steps, lr, teacher=target if distill else None,
                         kl_weight=kl_weight if distill else 0.0, hard_weight=hard_weight,
                         lr_floor=lr_floor, ema_decay=ema_decay)
        dm.eval()
        sel = spec_simulate(target, dm, sel_prompts, 4, 32, 0.0, args.seed)
        vl = eval_loss(dm, val_ids, args.seq)
        print(f"[draft-{v}] selection greedy acceptance k=4 (train-split prompts): {sel['acceptance_rate']:.3f}, "
              f"val loss {vl:.3f}", flush=True)
        variants[v] = {"model": dm, "state": st, "selection_acceptance_k4": sel["acceptance_rate"], "val_loss": vl}
    best = max(variants, key=lambda v: variants[v]["selection_acceptance_k4"])
    draft = variants[best]["model"]
    print(f"selected draft variant: {best}", flush=True)

    # ---- export + verify
    tdir, ddir = out / "target", out / "draft"
    export_hf(target, tcfg, tok_dir, tdir, eos_id)
    export_hf(draft, dcfg, tok_dir, ddir, eos_id)
    check_ids = val_ids[1000:1096].astype(np.int64)
    tcheck, (mt, mtok) = mlx_check(target, tdir, check_ids)
    dcheck, _ = mlx_check(draft, ddir, check_ids)
    print(f"mlx check target {tcheck}\nmlx check draft {dcheck}", flush=True)
    for nm, c in (("target", tcheck), ("draft", dcheck)):
        if c["argmax_agreement"] < 0.97 or c["max_abs_diff_vs_fp16_weights"] > 0.05 * max(1.0, c["logit_scale"]):
            print(f"WARNING: MLX/PyTorch logits disagree for {nm}: {c}", flush=True)

    # round-trip through the transformers tokenizer used by mlx_lm
    src = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    rt_ok = mtok.decode(mtok.encode(src, add_special_tokens=False)) == src

    import mlx_lm
    sample_prompt = "def fibonacci(n):"
    sample = mlx_lm.generate(mt, mtok, sample_prompt, max_tokens=80)
    samples = []
    for header in SAMPLE_HEADERS:
        text = mlx_lm.generate(mt, mtok, header, max_tokens=80)
        samples.append({"prompt": header, "greedy_continuation_mlx": text,
                        "has_return": "return" in text, "indented": "\n    " in text})

    # ---- metrics
    print("evaluating ...", flush=True)
    t_eval = time.time()
    tl, dl = eval_loss(target, val_ids, args.seq), eval_loss(draft, val_ids, args.seq)
    prompts = make_prompts(val_ids, args.eval_prompts, args.prompt_len, args.seed, eos_id, args.gen_len)
    accept = {"greedy": {}, "temperature_0.7": {}, "temperature_1.0": {}}
    for k in (2, 4, 8):
        accept["greedy"][f"k={k}"] = spec_simulate(target, draft, prompts, k, args.gen_len, 0.0, args.seed)
        print(f"greedy k={k}: {accept['greedy'][f'k={k}']}", flush=True)
    for T in (0.7, 1.0):
        accept[f"temperature_{T}"]["k=4"] = spec_simulate(target, draft, prompts, 4, args.gen_len, T, args.seed)
        print(f"T={T} k=4: {accept[f'temperature_{T}']['k=4']}", flush=True)

    def fsize(d):
        return (d / "model.safetensors").stat().st_size

    other = {v: {"selection_acceptance_k4": r["selection_acceptance_k4"], "val_loss": round(r["val_loss"], 4),
                 "steps": r["state"]["total"], "tokens": r["state"]["tokens"],
                 "train_seconds": round(r["state"]["seconds"], 1)} for v, r in variants.items()}
    order = list(variants)
    used = order[: order.index(best) + 1]
    steps_of = {v: variants[v]["state"]["total"] for v in used}
    repro = (f"nice -n 10 python bench/train_default_models.py --target-steps {tstate['total']}"
             f" --draft-dim {args.draft_dim} --draft-layers {args.draft_layers} --draft-heads {args.draft_heads}"
             f" --draft-ffn {args.draft_ffn}" + (" --draft-tie" if args.draft_tie else "")
             + f" --draft-variants {','.join(used)}"
             + (f" --draft-steps {steps_of['ce']}" if "ce" in steps_of else "")
             + (f" --finetune-steps {steps_of['ce+distill']} --kl-weight {args.kl_weight}" if "ce+distill" in steps_of else "")
             + (f" --kd-steps {steps_of['kd']} --kd-rows {args.kd_rows} --kd-gen {args.kd_gen} --kd-temps {args.kd_temps}"
                f" --kd-fraction {args.kd_fraction} --kd-lr {args.kd_lr}" if "kd" in steps_of else "")
             + (f" --greedy-steps {steps_of['greedy']} --greedy-rows {args.greedy_rows} --greedy-fraction"
                f" {args.greedy_fraction} --greedy-kl {args.greedy_kl} --greedy-lr {args.greedy_lr}"
                if "greedy" in steps_of else "")
             + (f" --polish-steps {steps_of['polish']} --polish-rows {args.polish_rows} --polish-kl {args.polish_kl}"
                f" --polish-ema {args.polish_ema} --polish-lr {args.polish_lr}" if "polish" in steps_of else "")
             + (f" --tests-from-step {args.tests_from_step}" if args.tests_from_step >= 0 else "")
             + (f" --draft-tests-from-step {args.draft_tests_from_step}" if args.draft_tests_from_step >= 0 else ""))
    metrics = {
        "reproduce": repro,
        "notes": args.note,
        "description": "Tiny llama target/draft pair trained on Python stdlib source (see README.md).",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "data": {
            "stdlib_path": str(stdlib),
            "train_files": len(train_docs), "val_files": len(val_docs),
            "train_tokens": int(len(train_ids)), "val_tokens": int(len(val_ids)),
            "val_modules": val_modules,
            "selection": f"sorted *.py; excluded dirs {sorted(EXCLUDED_DIRS)} and dirs starting with 'test'; "
                         f"files test_*.py; files > {MAX_FILE_BYTES} bytes; split: sha1(top-level module name) % 100 < {VAL_PERCENT} -> val",
            "test_suite": {
                "files": len(test_docs), "tokens": int(len(test_ids)),
                "target_from_step": args.tests_from_step, "drafts_from_step": args.draft_tests_from_step,
                "selection": f"sorted test/**/*.py <= {MAX_FILE_BYTES} bytes, minus test_<val module>* files and dirs; "
                             "training only (the tokenizer is trained on the core train split)",
            },
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": tok.get_vocab_size(), "eos_token": EOS,
                      "eos_token_id": eos_id, "bos_token_id": eos_id, "roundtrip_ok": rt_ok},
        "target": {"config": asdict(tcfg), "params": tp, "bytes": fsize(tdir), "val_loss": round(tl, 4),
                   "val_ppl": round(math.exp(tl), 3), "mlx_check": tcheck},
        "draft": {"config": asdict(dcfg), "params": n_params(draft), "bytes": fsize(ddir), "variant": best,
                  "val_loss": round(dl, 4), "val_ppl": round(math.exp(dl), 3), "mlx_check": dcheck,
                  "bytes_ratio_to_target": round(fsize(ddir) / fsize(tdir), 4)},
        "draft_variants": other,
        "training": {"seed": args.seed, "batch": args.batch, "seq": args.seq, "warmup": args.warmup,
                     "target_lr": args.target_lr, "draft_lr": args.draft_lr, "kl_weight": args.kl_weight,
                     "target_steps": tstate["total"], "target_tokens": tstate["tokens"],
                     "target_seconds": round(tstate["seconds"], 1),
                     "draft_steps": variants[best]["state"]["total"],
                     "draft_tokens": variants[best]["state"]["tokens"],
                     "draft_seconds": round(variants[best]["state"]["seconds"], 1),
                     "target_loss_curve": tstate["log"][:: max(1, len(tstate["log"]) // 40)],
                     **({"kd": {"rows": args.kd_rows, "prompt_tokens": args.prompt_len, "generated_tokens": args.kd_gen,
                                "temperatures": args.kd_temps, "generated_fraction": args.kd_fraction,
                                "lr": args.kd_lr, "steps": variants["kd"]["state"]["total"]}}
                        if "kd" in variants else {}),
                     **({"greedy": {"rows": args.greedy_rows, "prompt_tokens": args.prompt_len,
                                    "generated_tokens": args.kd_gen, "generated_fraction": args.greedy_fraction,
                                    "kl_weight": args.greedy_kl, "lr": args.greedy_lr,
                                    "steps": variants["greedy"]["state"]["total"]}}
                        if "greedy" in variants else {}),
                     **({"polish": {"rows": args.polish_rows, "prompt_tokens": args.prompt_len,
                                    "generated_tokens": args.kd_gen, "kl_weight": args.polish_kl,
                                    "ema_decay": args.polish_ema, "lr": args.polish_lr,
                                    "steps": variants["polish"]["state"]["total"]}}
                        if "polish" in variants else {})},
        "acceptance": {"prompts": len(prompts), "prompt_tokens": args.prompt_len, "generated_tokens": args.gen_len,
                       "source": "held-out (val) modules", **accept},
        "sample": {"prompt": sample_prompt, "greedy_continuation_mlx": sample},
        "function_headers": samples,
        "eval_seconds": round(time.time() - t_eval, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_readme(out, metrics, args)
    print(f"done in {(time.time()-T0)/60:.1f} min; wrote {out}", flush=True)


VARIANT_NOTES = {"ce+distill": ", i.e. the ce draft fine-tuned; numbers are for the fine-tune",
                 "kd": ", i.e. the ce+distill (or ce) draft fine-tuned on target continuations; numbers are for that stage",
                 "greedy": ", i.e. the kd (or earlier) draft fine-tuned towards the target's argmax; numbers are for that stage",
                 "polish": ", i.e. the greedy draft fine-tuned further, weights averaged; numbers are for that stage"}


def write_readme(out: Path, m, args):
    t, d, a = m["target"], m["draft"], m["acceptance"]
    tc, dc = t["config"], d["config"]
    g = a["greedy"]
    rows = "\n".join(
        f"| greedy, k={k} | {g[f'k={k}']['acceptance_rate']:.3f} | {g[f'k={k}'].get('alpha', float('nan')):.3f} | {g[f'k={k}']['mean_accepted_per_round']:.2f} | {g[f'k={k}']['tokens_per_round']:.2f} |"
        for k in (2, 4, 8))
    for T in ("0.7", "1.0"):
        r = a[f"temperature_{T}"]["k=4"]
        rows += f"\n| T={T}, k=4 | {r['acceptance_rate']:.3f} | {r.get('alpha', float('nan')):.3f} | {r['mean_accepted_per_round']:.2f} | {r['tokens_per_round']:.2f} |"
    tr = m["training"]
    kd = tr.get("kd")
    kd_text = ""
    if kd:
        kd_text = (f"\n\n`kd` = sequence-level distillation: the finished `ce+distill` draft (or `ce`, when "
                   f"`ce+distill` was not trained) fine-tuned "
                   f"({kd['steps']} steps, peak LR {kd['lr']}) with pure KL(target || draft) on batches that are "
                   f"{kd['generated_fraction']:.0%} the target's own continuations and the rest real training text. "
                   f"The continuations: {kd['rows']:,} training-split prompts of {kd['prompt_tokens']} tokens, each "
                   f"continued by {kd['generated_tokens']} tokens from the target (temperatures {kd['temperatures']}, "
                   f"equal shares; 0 = greedy). Speculation verifies exactly such text, so this is the text the "
                   f"draft should predict best.")
    gr = tr.get("greedy")
    if gr:
        kd_text += (f"\n\n`greedy` = the last of the drafts above fine-tuned ({gr['steps']} steps, peak LR {gr['lr']}) "
                    f"with {gr['kl_weight']} x KL(target || draft) + {1 - gr['kl_weight']:.2f} x CE(target's argmax) "
                    f"on batches that are {gr['generated_fraction']:.0%} the target's greedy continuations of "
                    f"{gr['rows']:,} other training-split prompts ({gr['prompt_tokens']} + {gr['generated_tokens']} "
                    f"tokens). Greedy speculation accepts a drafted token exactly when it is the target's argmax, "
                    f"so the CE term spends the draft's few parameters on the argmax rather than on the tail of "
                    f"the distribution; the KL term keeps the sampling acceptance from collapsing.")
    po = tr.get("polish")
    if po:
        kd_text += (f"\n\n`polish` = the `greedy` draft fine-tuned further ({po['steps']} steps, LR {po['lr']} constant "
                    f"after the warmup) with {po['kl_weight']} x KL(target || draft) + {1 - po['kl_weight']:.2f} x "
                    f"CE(target's argmax) on the target's greedy continuations of {po['rows']:,} further "
                    f"training-split prompts ({po['prompt_tokens']} + {po['generated_tokens']} tokens); the shipped "
                    f"weights are the moving average of the weights over those steps (decay {po['ema_decay']}).")
    stage_lr = {"polish": po and po["lr"], "greedy": gr and gr["lr"], "kd": kd and kd["lr"],
                "ce+distill": args.finetune_lr}
    draft_lr = stage_lr.get(d["variant"]) or tr["draft_lr"]
    variants = "\n".join(f"- `{v}`: val loss {r['val_loss']}, greedy acceptance k=4 on train-split prompts "
                         f"{r['selection_acceptance_k4']:.3f} ({r['steps']} steps, {r['tokens']/1e6:.2f}M tokens)"
                         for v, r in m["draft_variants"].items())
    heads = m.get("function_headers", [])
    headers = "\n".join(f"- `{h['prompt']}`: indented {'yes' if h['indented'] else 'no'}, "
                         f"`return` {'yes' if h['has_return'] else 'no'}" for h in heads)
    if heads:
        headers += "\n\n" + "\n".join(f"```python\n{h['prompt']}{h['greedy_continuation_mlx']}\n```" for h in heads[1:])
    ts = m["data"].get("test_suite")
    tests_text = ""
    if ts and ts["files"]:
        tests_text = (f"\nExtra training data: the stdlib's own test suite, {ts['files']} files, {ts['tokens']:,} tokens "
                      f"({ts['selection']}), mixed in from target step {ts['target_from_step']} and draft "
                      f"(fine-tune) step {ts['drafts_from_step']}.\n")
    text = f"""# Default models

A tiny **target / draft pair of Llama models** trained from scratch on Python source
code, shipped so that `mlx-spec generate` works offline (no Hugging Face download).
They are toy models: good at continuing Python code, useless for anything else.
Both share one byte-level BPE tokenizer and load with `mlx_lm.load(path)`.

Produced by `bench/train_default_models.py` (PyTorch training, float16 safetensors export
with Hugging Face `LlamaForCausalLM` key names). All numbers below come from `metrics.json`.

## Models

| | target | draft |
|---|---|---|
| hidden size | {tc['hidden_size']} | {dc['hidden_size']} |
| layers | {tc['num_hidden_layers']} | {dc['num_hidden_layers']} |
| heads (head dim) | {tc['num_attention_heads']} ({tc['hidden_size']//tc['num_attention_heads']}) | {dc['num_attention_heads']} ({dc['hidden_size']//dc['num_attention_heads']}) |
| MLP (SwiGLU) width | {tc['intermediate_size']} | {dc['intermediate_size']} |
| vocab | {tc['vocab_size']} | {dc['vocab_size']} |
| parameters | {t['params']:,} | {d['params']:,} |
| bytes (fp16 safetensors) | {t['bytes']:,} | {d['bytes']:,} ({d['bytes_ratio_to_target']:.3f} x target) |
| held-out loss (nats/token) | {t['val_loss']:.3f} | {d['val_loss']:.3f} |
| held-out perplexity | {t['val_ppl']:.2f} | {d['val_ppl']:.2f} |

RoPE theta 10000 (non-traditional / HF rotate-half), RMSNorm eps 1e-5, no biases,
{"draft: `lm_head` tied to the input embedding (the bytes saved buy width or depth); target: untied `lm_head`"
   if dc.get("tie_word_embeddings") else "untied `lm_head`"}, context trained at {args.seq} tokens.

Tokenizer: byte-level BPE, vocab {m['tokenizer']['vocab_size']}, `<|endoftext|>` = id
{m['tokenizer']['eos_token_id']} is EOS (also declared as BOS; no BOS is prepended when encoding).
Decoding round-trips source text exactly (newlines, indentation).

## Data

Python {m['python']} standard library sources (`sysconfig.get_paths()['stdlib']`):
{m['data']['selection']}.
Whole top-level modules/packages are held out, so validation code is never seen in training.
Train: {m['data']['train_files']} files, {m['data']['train_tokens']:,} tokens.
Validation: {m['data']['val_files']} files, {m['data']['val_tokens']:,} tokens
(modules: {', '.join(m['data']['val_modules'])}). Files are concatenated with `<|endoftext|>`.
{tests_text}
## Training

Seed {tr['seed']}, AdamW (betas 0.9/0.95, wd 0.1), batches of {tr['batch']} x {tr['seq']} tokens,
linear warmup + cosine decay to 10 %, grad clip 1.0, fp32 on CPU (2 threads).

- target: {tr['target_steps']} steps, {tr['target_tokens']/1e6:.2f}M tokens, {tr['target_seconds']/60:.1f} min, peak LR {tr['target_lr']}
- draft (`{d['variant']}`{VARIANT_NOTES.get(d['variant'], '')}): {tr['draft_steps']} steps, {tr['draft_tokens']/1e6:.2f}M tokens, {tr['draft_seconds']/60:.1f} min, peak LR {draft_lr}

Draft variants trained (`distill` = {tr['kl_weight']} x KL(target || draft) + {1-tr['kl_weight']:.1f} x CE,
`ce` = plain next-token CE, `ce+distill` = the finished `ce` draft fine-tuned with the distillation loss
at peak LR {args.finetune_lr}){kd_text}

The variant with the best greedy acceptance on training-split prompts is shipped:
{variants}

## Speculative-decoding acceptance (held-out code)

Simulated exactly in PyTorch on {a['prompts']} held-out prompts of {a['prompt_tokens']} tokens,
generating {a['generated_tokens']} tokens each. Greedy: the draft proposes k tokens, the target
accepts while they equal its argmax. Sampling: standard speculative sampling
(accept with prob min(1, p/q), residual resampling). Acceptance rate = accepted / drafted;
alpha = per-token acceptance probability (Leviathan et al.), estimated as
accepted / (accepted + rejections); tokens per round = accepted + 1.

| setting | acceptance rate (accepted / drafted) | alpha | mean accepted / round | tokens / round |
|---|---|---|---|---|
{rows}

MLX check: `mlx_lm.load` reproduces the PyTorch logits (max abs diff vs fp16-rounded weights
{t['mlx_check']['max_abs_diff_vs_fp16_weights']:.3g} target / {d['mlx_check']['max_abs_diff_vs_fp16_weights']:.3g} draft;
argmax agreement {t['mlx_check']['argmax_agreement']:.3f} / {d['mlx_check']['argmax_agreement']:.3f}).

## Sample

Target, greedy, `mlx_lm.generate(model, tokenizer, "def fibonacci(n):", max_tokens=80)`:

```python
{m['sample']['prompt']}{m['sample']['greedy_continuation_mlx']}
```

Greedy continuations (80 tokens) of several headers:
{headers}

## Reproduce

```
pip install torch tokenizers   # the `train` extra
{m['reproduce']}
```
(Checkpoints go to `bench/.cache/default_models/`; rerunning resumes from them. Bitwise
identity also needs the same Python version, since the data is the running interpreter's stdlib.)
""" + (f"\nNotes: {m['notes']}\n" if m.get("notes") else "")
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
