"""`mlx-spec generate`: stream text to stdout, the round stats to stderr."""

from __future__ import annotations

import os

import click

from ..defaults import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE,
                        DEFAULT_QUANTIZED_KV_START, DEFAULT_XTC_THRESHOLD,
                        MLX_LM_PREFILL_STEP_SIZE)
from .models import launched_group, load_pair, load_sharded
from .options import (SEED, adapter_option, apply_chat_template, check_mtp, json_kwargs,
                      model_options, mtp_options, read_prompt, sampling_options,
                      speculation_options, trust_option)

SOURCE_COLORS = {"draft": "green", "lookup": "cyan", "suffix": "cyan", "mtp": "green",
                 "dflash": "green"}


@click.command()
@model_options
@click.option("--prompt", "-p", default="def fibonacci(n):", show_default=True, help="Prompt text, or - to read standard input.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True)
@sampling_options
@speculation_options
@click.option("--seed", type=SEED, default=None, help="Random seed for reproducible sampling.")
@click.option("--ignore-chat-template", is_flag=True, help="Feed the prompt as is, even if the tokenizer has a chat template.")
@click.option("--system-prompt", default=None, help="A system message before the prompt in the chat template (mlx-lm's option).")
@click.option("--prefill-response", default=None, help="Begin the answer with this text, which the model continues (mlx-lm's option; with the chat template).")
@click.option("--extra-eos-token", multiple=True, help="Another token that ends the answer (mlx-lm's option; repeatable).")
@click.option("--min-tokens-to-keep", type=click.IntRange(min=1), default=1, show_default=True, help="With --min-p: the fewest tokens it keeps (mlx-lm's option).")
@click.option("--xtc-probability", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True, help="XTC sampling: the chance of excluding the top choices (mlx-lm's option; its draws decide acceptance, exactly).")
@click.option("--xtc-threshold", type=click.FloatRange(0.0, 0.5), default=DEFAULT_XTC_THRESHOLD, show_default=True, help="XTC sampling: the probability above which choices are excluded.")
@click.option("--max-kv-size", type=click.IntRange(min=1), default=None, help="Sliding-window KV caches of this many tokens (mlx-lm's option).")
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=None, help=f"Prompt tokens prefilled at a time (default {DEFAULT_PREFILL_STEP_SIZE}; with --kv-bits or --max-kv-size {MLX_LM_PREFILL_STEP_SIZE}, mlx-lm's, whose chunks decide where a long prompt's cache is quantized and what a chunk sees of a window's first tokens).")
@click.option("--chat-template-config", default=None, callback=json_kwargs, help="A JSON object of keyword arguments for the chat template, e.g. '{\"enable_thinking\": false}' (mlx-lm's option).")
@click.option("--suffix", is_flag=True, help="Draft from everything seen before: the prompt and output so far and, with --suffix-file, every earlier run's (suffix drafting, in front of prompt lookup at --temp 0 and the draft model).")
@click.option("--suffix-file", type=click.Path(dir_okay=False), default=None, help="With --suffix (implied): read the suffix index from this file when it exists, and write it back with this run's text added.")
@click.option("--color", is_flag=True, help="Colour tokens by source: green = draft model, MTP layer or DFlash drafter, cyan = prompt lookup or suffix drafting.")
@click.option("--quiet", "-q", is_flag=True, help="Do not print the stats.")
@click.option("--tree", default="auto", show_default=True, callback=lambda ctx, param, value: tree_shape(value), help="Token trees from the draft model, an MTP, EAGLE-3 or DFlash drafter, prompt lookup and suffix drafting, verified in one pass: DxW (e.g. 3x2: depth 3, width 2), off (chains), auto (the policy's choice of the model drafter's width, 1-3, from its model of the measured verify cost). Chains where the target's cache cannot verify a tree (recurrent state).")
@mtp_options
@adapter_option
@trust_option
@click.option("--kv-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]), default=None, callback=lambda ctx, param, value: None if value is None else int(value), help="Quantize the target's KV cache to this many bits once it holds --quantized-kv-start tokens (mlx-lm's option; the same text as mlx-lm's with it). Default: no quantization.")
@click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default=str(DEFAULT_KV_GROUP_SIZE), show_default=True, callback=lambda ctx, param, value: int(value), help="Group size for KV cache quantization.")
@click.option("--quantized-kv-start", type=click.IntRange(min=0), default=DEFAULT_QUANTIZED_KV_START, show_default=True, help="With --kv-bits: the number of tokens the cache holds when it is quantized.")
@click.option("--sharding", type=click.Choice(["auto", "tensor", "pipeline"]), default="auto", show_default=True, help="Under mlx.launch with several ranks: split the target by tensor parallelism or pipeline stages (auto: tensor when the model class allows).")
def generate(model, draft_model, prompt, max_tokens, temp, top_p, top_k, min_p,
             num_draft_tokens, adaptive, max_draft_tokens, no_auto_off, draft_confidence,
             seed, no_draft, prompt_lookup, prompt_lookup_max_ngram, suffix, suffix_file,
             ignore_chat_template, system_prompt, prefill_response, extra_eos_token,
             min_tokens_to_keep, xtc_probability, xtc_threshold, max_kv_size,
             prefill_step_size, chat_template_config, color, calibration,
             quiet, tree, mtp, mtp_weights, adapter_path, trust_remote_code, kv_bits,
             kv_group_size, quantized_kv_start, sharding, dequantize):
    """Generate text, streaming it to stdout; stats go to stderr."""
    from ..generate import stream_generate

    prompt = read_prompt(prompt)
    check_mtp(mtp, mtp_weights, draft_model, no_draft)
    group = launched_group()  # None unless mlx.launch started several ranks
    if group is None and sharding != "auto":
        raise click.UsageError("--sharding only applies under mlx.launch with two or more ranks.")
    if group is None:
        target_model, tokenizer, draft = load_pair(model, draft_model, no_draft or mtp,
                                                   dequantize=dequantize,
                                                   adapter_path=adapter_path,
                                                   trust_remote_code=trust_remote_code)
    elif adapter_path is not None:
        raise click.UsageError("--adapter-path applies to one machine's target, not a sharded "
                               "one.")
    elif dequantize:
        raise click.UsageError("--dequantize applies to one machine's models, not a sharded "
                               "target.")
    else:
        target_model, tokenizer, draft = load_sharded(model, draft_model, no_draft or mtp,
                                                       group, sharding)
    for token in extra_eos_token:
        try:
            tokenizer.add_eos_token(token)
        except ValueError:
            raise click.UsageError(f"--extra-eos-token {token!r} is not a token of this "
                                   "tokenizer's vocabulary.") from None
    if not ignore_chat_template:
        prompt = apply_chat_template(tokenizer, prompt, chat_template_config, system_prompt,
                                     prefill_response)
    sampling = dict(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if xtc_probability > 0 or min_tokens_to_keep != 1:  # mlx-lm's sampler, as its generate
        from mlx_lm.sample_utils import make_sampler

        sampling = {"sampler": make_sampler(
            temp, top_p, min_p, min_tokens_to_keep, top_k=top_k,
            xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
            xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))}
    shown = group is None or group.rank() == 0  # only rank 0 prints text and stats
    index = suffix_index(suffix_file) if suffix or suffix_file else None

    response = None
    try:
        for response in stream_generate(
            target_model, tokenizer, prompt, draft_model="mtp" if mtp else draft,
            max_tokens=max_tokens,
            num_draft_tokens=num_draft_tokens, adaptive=adaptive,
            max_draft_tokens=max_draft_tokens, auto_off=not no_auto_off,
            draft_confidence=draft_confidence, **sampling, seed=seed, prompt_lookup=prompt_lookup,
            prompt_lookup_max_ngram=prompt_lookup_max_ngram,
            calibration="auto" if calibration else None, mtp_weights=mtp_weights,
            suffix=index, tree=tree, kv_bits=kv_bits, kv_group_size=kv_group_size,
            quantized_kv_start=quantized_kv_start, max_kv_size=max_kv_size,
            prefill_step_size=prefill_step_size,
        ):
            fg = SOURCE_COLORS.get(response.source) if color else None
            text = click.style(response.text, fg=fg) if fg else response.text
            if shown:
                click.echo(text, nl=False, color=True if color else None)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if suffix_file is not None and shown:
        index.save(suffix_file)
    if not shown:
        return
    click.echo()
    if response is not None and not quiet:
        click.echo("=" * 10, err=True)
        click.echo(response.stats.summary(), err=True)


def tree_shape(value: str):
    """--tree's value as the API's `tree=`: auto -> None, off -> False, DxW -> (D, W)."""
    if value == "auto":
        return None
    if value == "off":
        return False
    depth, x, width = value.lower().partition("x")
    if not (x and depth.isdigit() and width.isdigit() and int(depth) >= 1 and int(width) >= 1):
        raise click.BadParameter(f"give auto, off or DEPTHxWIDTH such as 3x2, not {value!r}.")
    return int(depth), int(width)


def suffix_index(path):
    """The index to draft from: the file's when it exists, else a new one."""
    from ..drafters.suffix_index import SuffixIndex

    if path is None or not os.path.exists(path):
        return SuffixIndex()
    try:
        return SuffixIndex.load(path)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
