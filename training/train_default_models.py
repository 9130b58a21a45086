#!/usr/bin/env python3
"""Train the small target/draft llama pair shipped in ``mlx_spec/default_models``,
and the target's MTP head.

Training-only script: needs the ``train`` extra (``pip install torch tokenizers``)
plus ``mlx-lm`` for the export check.  The mlx_spec runtime never imports torch.

Pipeline (every stage is seeded; the run is resumable from checkpoints kept in
``--work-dir``, which defaults to the git-ignored ``training/.cache/``); each stage
lives in a module of ``training/``:

1. ``data``: Python source files of the running interpreter's standard library,
   split by top-level module (~5% held out); byte-level BPE tokenizer; batches.
2. ``models``: minimal Llama in PyTorch (HF LlamaForCausalLM names) and the MTP head.
3. ``stages``: the target (AdamW, warmup + cosine decay); draft(s) distilled from
   the target and/or trained with plain CE, the one with the best greedy
   acceptance on *training-split* prompts exported; the target's continuations.
4. ``export`` / ``evaluation``: HF layout (float16 safetensors), the check that
   mlx_lm reproduces the PyTorch logits, held-out loss, simulated speculative
   acceptance; ``report`` writes metrics.json's README.md.
5. ``--mtp-only``: the MTP head (``mtp``): one decoder layer on the frozen shipped
   target's hidden states, distilled from it at depths 1 and 2, exported to
   ``mtp/`` in DeepSeek-V3's layout and checked through mlx_spec.

The number of optimisation steps is fixed at the start of a stage: either
``--target-steps/--draft-steps`` or derived from the ``--*-minutes`` budget via
a short timing run.  The steps actually used are recorded in metrics.json, so an
exact reproduction passes them explicitly (its "reproduce" lines).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from training.data import (EOS, EXCLUDED_DIRS, MAX_FILE_BYTES, SAMPLE_HEADERS, VAL_PERCENT, KDMix,
                           encode_stream, load_corpus, load_test_corpus, make_prompts, module_key,
                           train_tokenizer, write_tokenizer_files)
from training.evaluation import eval_loss, mlx_check, spec_simulate
from training.export import export_hf
from training.models import LlamaConfig, build_model, n_params
from training.report import write_readme
from training.stages import kd_stream, train_stage

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "mlx_spec" / "default_models"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=str(REPO / "training" / ".cache" / "default_models"))
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
    ap.add_argument("--mtp-only", action="store_true",
                    help="train only the MTP head, on the target already in --out-dir (its float16 weights), "
                         "leaving the target and draft as they are; writes --out-dir/mtp and metrics.json['mtp']")
    ap.add_argument("--mtp-ffn", type=int, default=512, help="MTP head: MLP width of its decoder layer")
    ap.add_argument("--mtp-rows", type=int, default=4096,
                    help="MTP head: training-split prompts continued greedily by the target (--kd-gen tokens)")
    ap.add_argument("--mtp-fraction", type=float, default=0.75, help="share of each MTP batch from those rows")
    ap.add_argument("--mtp-kl", type=float, default=0.5,
                    help="MTP head loss per depth: this x KL(target || head) + the rest x CE(target's argmax)")
    ap.add_argument("--mtp-depth2", type=float, default=0.5, help="weight of the depth-2 (chained) loss")
    ap.add_argument("--mtp-minutes", type=float, default=25)
    ap.add_argument("--mtp-steps", type=int, default=0)
    ap.add_argument("--mtp-lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="", help="free text recorded in metrics.json/README.md")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--ckpt-every", type=float, default=120, help="seconds")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    args = ap.parse_args()
    for name in ("kl_weight", "kd_fraction", "greedy_fraction", "greedy_kl", "polish_kl", "polish_ema",
                 "mtp_fraction", "mtp_kl"):
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
        if args.mtp_only:  # the shipped target's own tokenizer
            from tokenizers import Tokenizer
            tok_dir.mkdir(parents=True, exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(out / "target" / f, tok_dir / f)
            tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
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

    if args.mtp_only:
        return mtp_main(args, work, out, train_ids, val_ids, kd_real, eos_id, T0)

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
    repro = (f"nice -n 10 python -m training.train_default_models --target-steps {tstate['total']}"
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
    previous = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
    if "mtp" in previous:  # the MTP head (--mtp-only) is trained on the shipped target separately
        metrics["mtp"] = previous["mtp"]
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_readme(out, metrics, args)
    print(f"done in {(time.time()-T0)/60:.1f} min; wrote {out}", flush=True)



def mtp_main(args, work: Path, out: Path, train_ids, val_ids, kd_real, eos_id: int, T0: float):
    """Train, export, check and measure the MTP head of the target shipped in ``out``."""
    import torch

    from training.mtp import (MTPDrafts, export_mtp, head_config, load_exported, mlx_check_mtp,
                              mtp_eval)
    from training.models import MTPHead, init_mtp_from_target
    from training.stages import mtp_loss

    target, tcfg = load_exported(out / "target")
    draft, _ = load_exported(out / "draft")
    torch.manual_seed(args.seed + 3)
    head = MTPHead(head_config(tcfg, args.mtp_ffn))
    init_mtp_from_target(head, target)
    m_path = work / f"mtp_{args.mtp_rows}x{args.prompt_len}+{args.kd_gen}.npz"
    m_ids = kd_stream(target, train_ids, args.mtp_rows, args.prompt_len, args.kd_gen, [0.0],
                      args.seed + 19, eos_id, m_path)
    print(f"[mtp] {len(m_ids)/1e6:.2f}M tokens of greedy target continuations ({m_path.name}); "
          f"head {n_params(head):,} params", flush=True)
    head.train()
    state = train_stage("mtp", head, KDMix(kd_real, m_ids, args.mtp_fraction), args,
                        work / f"mtp_head_ffn{args.mtp_ffn}.ckpt", args.mtp_minutes, args.mtp_steps, args.mtp_lr,
                        loss_fn=lambda h, x, y: mtp_loss(h, target, x, args.mtp_kl, args.mtp_depth2))
    head.eval()
    mdir = out / "mtp"
    repro = (f"nice -n 10 python -m training.train_default_models --mtp-only --mtp-steps {state['total']}"
             f" --mtp-ffn {args.mtp_ffn} --mtp-rows {args.mtp_rows} --mtp-fraction {args.mtp_fraction}"
             f" --mtp-kl {args.mtp_kl} --mtp-depth2 {args.mtp_depth2} --mtp-lr {args.mtp_lr}"
             + (f" --draft-tests-from-step {args.draft_tests_from_step}" if args.draft_tests_from_step >= 0 else ""))
    export_mtp(head, tcfg, mdir, {"trained_for": "mlx_spec/default_models/target", "reproduce": repro})
    check = mlx_check_mtp(head, target, out / "target", mdir, val_ids[1000:1096].astype(np.int64))
    print(f"[mtp] mlx check {check}", flush=True)
    if check["argmax_agreement"] < 0.97:
        print(f"WARNING: MLX/PyTorch MTP logits disagree: {check}", flush=True)

    t_eval = time.time()
    quality = mtp_eval(head, target, val_ids, args.seq)
    print(f"[mtp] held-out {quality}", flush=True)
    prompts = make_prompts(val_ids, args.eval_prompts, args.prompt_len, args.seed, eos_id, args.gen_len)
    drafts = MTPDrafts(target, head)
    # each result is kept as it comes (the simulation is slow on 2 cores): a rerun skips it
    done_path = work / f"mtp_eval_ffn{args.mtp_ffn}_{state['total']}.json"
    accept = json.loads(done_path.read_text()) if done_path.exists() else {"mtp": {}, "draft": {}}
    runs = [("mtp", drafts, k, 0.0) for k in (1, 2, 4)] + [("draft", draft, 1, 0.0)] \
        + [("mtp", drafts, 4, T) for T in (0.7, 1.0)]
    for name, drafter, k, T in runs:
        setting = f"greedy k={k}" if T == 0 else f"T={T} k={k}"
        if setting not in accept[name]:
            accept[name][setting] = spec_simulate(target, drafter, prompts, k, args.gen_len, T, args.seed)
            done_path.write_text(json.dumps(accept, indent=2))
        print(f"[{name}] {setting}: {accept[name][setting]}", flush=True)

    metrics = json.loads((out / "metrics.json").read_text())
    size = (mdir / "model.safetensors").stat().st_size
    metrics["mtp"] = {
        "reproduce": repro,
        "config": json.loads((mdir / "mtp_config.json").read_text()),
        "params": n_params(head), "bytes": size, "bytes_ratio_to_draft": round(size / metrics["draft"]["bytes"], 4),
        "training": {"seed": args.seed, "batch": args.batch, "seq": args.seq, "warmup": args.warmup,
                     "steps": state["total"], "tokens": state["tokens"], "seconds": round(state["seconds"], 1),
                     "lr": args.mtp_lr, "kl_weight": args.mtp_kl, "depth2_weight": args.mtp_depth2,
                     "rows": args.mtp_rows, "prompt_tokens": args.prompt_len, "generated_tokens": args.kd_gen,
                     "generated_fraction": args.mtp_fraction, "init": "target's last layer (MLP cut), final norm",
                     "loss_curve": state["log"][:: max(1, len(state["log"]) // 40)]},
        "held_out": quality,
        "mlx_check": check,
        "acceptance": {"prompts": len(prompts), "prompt_tokens": args.prompt_len,
                       "generated_tokens": args.gen_len, "source": "held-out (val) modules, the draft's prompts",
                       **accept},
        "eval_seconds": round(time.time() - t_eval, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_readme(out, metrics, args)
    print(f"done in {(time.time()-T0)/60:.1f} min; wrote {mdir}", flush=True)


if __name__ == "__main__":
    main()
