"""`mlx-spec check`: a chi-square test that speculation leaves the output distribution unchanged."""

from __future__ import annotations

import sys

import click

from .generate import tree_shape
from .models import load_pair
from .options import SEED, dequantize_option, read_prompt


@click.command()
@click.option("--model", "-m", default=None, help="Target model (default: the shipped pair).")
@click.option("--draft-model", "-d", default=None, help="Draft model; the worse it is, the sharper the check.")
@click.option("--prompt", "-p", default="def fibonacci(n):", show_default=True)
@click.option("--samples", type=click.IntRange(min=100), default=2000, show_default=True)
@click.option("--temp", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--min-p", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.0, show_default=True)
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--prompt-lookup", is_flag=True, help="Check n-gram drafting instead of (or before) the draft model.")
@click.option("--suffix", is_flag=True, help="Check suffix drafting (each sample drafts from the earlier samples' text) instead of (or before) the draft model.")
@click.option("--tree", default="off", show_default=True, callback=lambda ctx, param, value: tree_shape(value), help="Check token trees of this shape from the drafters that have them (the draft model, a head, a DFlash drafter, prompt lookup, suffix drafting): DxW (e.g. 2x3), or off (chains). The negative control runs chains.")
@click.option("--negative-control", is_flag=True, help="Also run a deliberately broken rule, to show the check can fail.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@dequantize_option
def check(model, draft_model, prompt, samples, temp, top_p, top_k, min_p, num_draft_tokens,
          prompt_lookup, suffix, tree, negative_control, seed, dequantize):
    """Statistically check that speculation leaves the output distribution unchanged.

    Samples the first two tokens SAMPLES times with speculation and compares them
    with the target's exact distribution (chi-square). Exits 1 if they differ.
    """
    from ..acceptance import resample_from_target_accept
    from ..drafters.suffix_index import SuffixIndex
    from ..exactness import check_exactness
    from ..sampling import SamplingConfig

    prompt = read_prompt(prompt)
    target_model, tokenizer, draft = load_pair(model, draft_model, False, dequantize=dequantize)
    if draft is None and not prompt_lookup and not suffix:
        raise click.UsageError("Give --draft-model, --prompt-lookup or --suffix: there is nothing "
                               "to check.")
    sampling = SamplingConfig(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    ids = tokenizer.encode(prompt)
    runs = [("speculative (exact rule)", None)]
    if negative_control:
        runs.append(("negative control (resample from p)", resample_from_target_accept))
    failed = False
    for name, accept in runs:
        click.echo(f"{name}: sampling {samples} times ...", err=True)
        try:
            result = check_exactness(target_model, draft, ids, sampling, samples=samples,
                                     num_draft_tokens=num_draft_tokens, accept=accept,
                                     prompt_lookup=prompt_lookup, seed=seed,
                                     suffix=SuffixIndex() if suffix else None,
                                     tree=tree if accept is None else False)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        verdict = "indistinguishable from the target" if result.passed else "DIFFERS from the target"
        click.echo(f"{name}: chi2 = {result.statistic:.1f} on {result.dof} dof, "
                   f"p = {result.p_value:.3g}, acceptance {result.acceptance_rate:.1%} -> {verdict}")
        failed |= accept is None and not result.passed
    if failed:
        sys.exit(1)
