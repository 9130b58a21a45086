"""The MTP head of the shipped target: drafting from it in the simulation, its
export in the layout ``mlx_spec.mtp`` reads, and the check that MLX reproduces it.

Export layout (DeepSeek-V3's published names, the layer after the trunk's last):
``model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm}.weight`` and the
decoder layer's own ``model.layers.{N}.self_attn.*`` / ``mlp.*`` / norms, float16,
in ``model.safetensors``; ``mtp_config.json`` records the layer's shape (its MLP
is narrower than the target's), which the target's own config cannot say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .models import LlamaConfig, MTPHead

MTP_CONFIG = "mtp_config.json"


def head_config(target_cfg: LlamaConfig, ffn: int) -> LlamaConfig:
    """The head's decoder layer: the target's width and heads, an MLP of width ``ffn``."""
    return LlamaConfig(target_cfg.vocab_size, target_cfg.hidden_size, 1, target_cfg.num_attention_heads,
                       ffn, target_cfg.rms_norm_eps, target_cfg.rope_theta,
                       target_cfg.max_position_embeddings)


class MTPDrafts:
    """``spec_simulate``'s drafter for the MTP head: from scratch each round (exact, no reuse).

    Pairs (h_i, x_{i+1}) over the context give g at the last pair: d1; each further draft
    feeds g back with the token just drafted, one position later, through the head's cache."""

    def __init__(self, target, head: MTPHead):
        self.target, self.head = target, head

    def steps(self, ctx):
        import torch

        h = self.target.hidden(ctx[:, :-1])  # (1, L-1, H)
        e = self.target.model.embed_tokens(ctx[:, 1:])
        e[:, 0] = 0
        cache, offset = [None], ctx.shape[1] - 1
        g = self.head(e, h, 0, cache)[:, -1:]  # (1, 1, H)
        while True:
            token = yield self.target.lm_head(g)[0, -1].float()
            g = self.head(self.target.model.embed_tokens(torch.tensor([[token]])), g, offset, cache)
            offset += 1


def export_mtp(head: MTPHead, target_cfg: LlamaConfig, out: Path, extra: dict):
    """float16 safetensors under DeepSeek-V3's names + mtp_config.json."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    prefix = f"model.layers.{target_cfg.num_hidden_layers}."
    sd = {prefix + k.removeprefix("block."): v.detach().to(torch.float16).contiguous()
          for k, v in head.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)
    config = {
        "mtp_layout": "deepseek",  # enorm, hnorm, eh_proj, one decoder layer, shared_head.norm
        "model_type": "llama",  # the decoder layer's class: the target's own
        "num_nextn_predict_layers": 1,
        "hidden_size": head.cfg.hidden_size,
        "num_attention_heads": head.cfg.num_attention_heads,
        "num_key_value_heads": head.cfg.num_attention_heads,
        "intermediate_size": head.cfg.intermediate_size,
        "rms_norm_eps": head.cfg.rms_norm_eps,
        "rope_theta": head.cfg.rope_theta,
        "torch_dtype": "float16",
        **extra,
    }
    (out / MTP_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def mlx_check_mtp(head: MTPHead, target, target_dir: Path, mtp_dir: Path, ids: np.ndarray):
    """The exported head through mlx_spec (its loader, its block, chained steps) against PyTorch:
    logits at depth 1 for every pair of ``ids`` and at depth 2 after its last pair."""
    import copy

    import mlx.core as mx
    import torch

    import mlx_spec
    from mlx_spec.mtp import load_mtp, split_target

    model, _ = mlx_spec.load(str(target_dir))
    mhead = load_mtp(model, str(mtp_dir))
    trunk, _ = split_target(model)
    x = mx.array(ids[None].astype(np.int32))
    hidden = trunk(x[:, :-1])[0]  # (L-1, H)
    cache = mhead.make_cache()[0]
    g = mhead(x[0, 1:], hidden, cache)  # (L-1, H)
    nxt = mx.argmax(mhead.logits(g[-1]))
    g2 = mhead(nxt[None].astype(mx.uint32), g[-1:], cache)
    ml = np.array(mx.concatenate([mhead.logits(g), mhead.logits(g2)]).astype(mx.float32))

    def torch_logits(h, t):
        ctx = torch.from_numpy(ids[None].astype(np.int64))
        steps = MTPDrafts(t, h).steps(ctx)
        with torch.inference_mode():
            hid = t.hidden(ctx[:, :-1])
            e = t.model.embed_tokens(ctx[:, 1:])
            e[:, 0] = 0
            depth1 = t.lm_head(h(e, hid))[0]
            first = next(steps)
            depth2 = steps.send(int(np.argmax(ml[-2])))
        assert torch.allclose(first, depth1[-1].float(), atol=1e-4)
        return torch.cat([depth1, depth2[None]]).numpy()

    tl32 = torch_logits(head, target)
    h16, t16 = copy.deepcopy(head), copy.deepcopy(target)
    for p in list(h16.parameters()) + list(t16.parameters()):
        p.data = p.data.half().float()
    tl16 = torch_logits(h16, t16)
    return {
        "max_abs_diff_vs_fp32": float(np.abs(ml - tl32).max()),
        "max_abs_diff_vs_fp16_weights": float(np.abs(ml - tl16).max()),
        "argmax_agreement": float((ml.argmax(-1) == tl32.argmax(-1)).mean()),
        "logit_scale": float(np.abs(tl32).max()),
    }


def mtp_eval(head: MTPHead, target, val: np.ndarray, seq: int, max_windows=64):
    """On held-out windows: the head's CE on the text (x_{i+2}), KL(target || head), and how often
    its argmax is the target's (depth 1; greedy drafting's per-token acceptance without chaining)."""
    import torch
    import torch.nn.functional as F

    n = (len(val) - 1) // seq
    idx = np.linspace(0, n - 1, num=min(n, max_windows)).astype(int)
    ce = kl = agree = cnt = 0.0
    with torch.inference_mode():
        for i in range(0, len(idx), 16):
            x = torch.from_numpy(np.stack([val[j * seq: j * seq + seq].astype(np.int64) for j in idx[i: i + 16]]))
            h = target.hidden(x)
            tlogp = F.log_softmax(target.lm_head(h), -1)[:, 1:]
            e = target.model.embed_tokens(x[:, 1:])
            e[:, 0] = 0
            logq = F.log_softmax(target.lm_head(head(e, h[:, :-1])), -1)[:, :-1]  # pairs 0..T-3
            tl = tlogp[:, :-1]
            ce += F.nll_loss(logq.reshape(-1, logq.size(-1)), x[:, 2:].reshape(-1), reduction="sum").item()
            kl += (tl.exp() * (tl - logq)).sum().item()
            agree += (logq.argmax(-1) == tl.argmax(-1)).sum().item()
            cnt += x[:, 2:].numel()
    return {"val_ce_two_ahead": round(ce / cnt, 4), "val_kl_to_target": round(kl / cnt, 4),
            "val_argmax_agreement": round(agree / cnt, 4)}


def load_exported(path: Path):
    """A model exported by ``export_hf`` back into PyTorch (float32 from its float16 weights)."""
    from safetensors.torch import load_file

    from .models import build_model

    c = json.loads((path / "config.json").read_text())
    cfg = LlamaConfig(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                      c["intermediate_size"], c["rms_norm_eps"], c["rope_theta"],
                      c["max_position_embeddings"], c["tie_word_embeddings"])
    model = build_model(cfg)
    sd = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg
