"""The default models' README.md, written from metrics.json."""

from __future__ import annotations

from pathlib import Path


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

Produced by `python -m training.train_default_models` (PyTorch training, float16 safetensors export
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

{mtp_section(m)}## Sample

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
(Checkpoints go to `training/.cache/default_models/`; rerunning resumes from them. Bitwise
identity also needs the same Python version, since the data is the running interpreter's stdlib.)
""" + (f"\nNotes: {m['notes']}\n" if m.get("notes") else "")
    (out / "README.md").write_text(text)


def mtp_section(m) -> str:
    """The README's section on the target's MTP head (metrics.json["mtp"]), or nothing."""
    h = m.get("mtp")
    if not h:
        return ""
    c, tr, a, q = h["config"], h["training"], h["acceptance"], h["held_out"]
    draft_greedy = {**{f"greedy {k}": v for k, v in m["acceptance"]["greedy"].items()},
                    **a.get("draft", {})}
    draft_sampled = {f"T={T} k=4": m["acceptance"][f"temperature_{T}"]["k=4"] for T in ("0.7", "1.0")}
    rows = []
    for setting, r in a["mtp"].items():
        d = draft_greedy.get(setting) or draft_sampled.get(setting)
        vs = f"{d['acceptance_rate']:.3f} / {d['tokens_per_round']:.2f}" if d else "-"
        rows.append(f"| {setting} | {r['acceptance_rate']:.3f} | {r['alpha']:.3f} | {r['tokens_per_round']:.2f} | {vs} |")
    table = "\n".join(rows)
    return f"""## MTP head (`mtp/`)

The target's own multi-token-prediction head: one Llama decoder layer in DeepSeek-V3's layout
(`model.layers.{m['target']['config']['num_hidden_layers']}.{{enorm, hnorm, eh_proj, self_attn.*, mlp.*, shared_head.norm}}`),
reading the target's last hidden state (after its final norm) and the embedding of the next
token, with the target's own embedding and `lm_head` (not copied): `draft_model="mtp"` /
`mlx-spec generate --mtp` find it with no argument. Its decoder layer: hidden {c['hidden_size']},
{c['num_attention_heads']} heads, MLP width {c['intermediate_size']} (narrower than the target's, so that the head fits the
draft's budget; `mtp_config.json` records the shape). {h['params']:,} parameters, {h['bytes']:,} bytes
(fp16 safetensors, {h['bytes_ratio_to_draft']:.3f} x the draft model).

Training: distilled from the frozen shipped target ({tr['steps']} steps of {tr['batch']} x {tr['seq']} tokens,
{tr['seconds']/60:.1f} min, peak LR {tr['lr']}, warmup {tr['warmup']}, cosine to 10 %, seed {tr['seed']}); init: the {tr['init']}.
Batches: {tr['generated_fraction']:.0%} the target's greedy continuations of {tr['rows']:,} training-split prompts
({tr['prompt_tokens']} + {tr['generated_tokens']} tokens), the rest real training text. Loss per depth:
{tr['kl_weight']} x KL(target || head) + {1 - tr['kl_weight']:.2f} x CE(target's argmax), where depth 1 at pair
(h_i, x_(i+1)) matches the target's distribution at position i + 1 and depth 2 (weight {tr['depth2_weight']}) feeds the
head its own output with the embedding of x_(i+2), one position later, as drafting at depth 2 does.
Held-out: CE on the text two tokens ahead {q['val_ce_two_ahead']:.3f}, KL to the target {q['val_kl_to_target']:.3f},
argmax agreement with the target (depth 1) {q['val_argmax_agreement']:.3f}.

Acceptance, simulated as above on the same {a['prompts']} held-out prompts (the head drafts d1 from the pair
at the last position, then chains its own output); the last column is the draft model's:

| setting | acceptance rate | alpha | tokens / round | draft model: acceptance / tokens per round |
|---|---|---|---|---|
{table}

MLX check: `mlx_spec`'s loader and block reproduce the PyTorch head (depth 1 at every position and
one chained step; max abs diff vs fp16-rounded weights {h['mlx_check']['max_abs_diff_vs_fp16_weights']:.3g},
argmax agreement {h['mlx_check']['argmax_agreement']:.3f}).

Reproduce (after the pair; the head needs only the shipped target):
```
{h['reproduce']}
```

"""
