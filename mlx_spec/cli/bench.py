"""`mlx-spec bench`: flags in, files and a summary out. No maths (that is mlx_spec.bench).

Progress lines and the summary go to stderr and stdout; every figure goes to
the JSON file, the readable report next to it (Markdown), plots when
matplotlib is installed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import click

from .models import load_pair, resolve_models
from .options import SEED, dequantize_option

DEFAULT_JSON = "mlx-spec-bench.json"


def _resolve(model, draft_model):
    """The pair to measure (the shipped one by default); the bench needs a draft."""
    model, draft_model = resolve_models(model, draft_model, no_draft=False)
    if draft_model is None:
        raise click.UsageError("Benchmarking speculation needs a draft: pass --draft-model PATH.")
    return model, draft_model


def _parse_sizes(text: str):
    try:
        sizes = tuple(tuple(int(v) for v in part.lower().split("x")) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise click.UsageError(f"--target-sizes wants HIDDENxLAYERS pairs such as 512x8,1024x16; got {text!r}.")
    return sizes


@click.command()
@click.option("--model", "-m", default=None, help="Target model: local directory or Hugging Face repo id (default: the shipped pair).")
@click.option("--draft-model", "-d", default=None, help="Draft model (of the target's tokenizer, or of another: drafted across it), or a DFlash drafter's directory.")
@click.option("--quick", is_flag=True, help="A few minutes: fewer k, temperatures, prompts, sizes and repeats.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=DEFAULT_JSON, show_default=True, help="Where to write every figure as JSON.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, help="Markdown report path [default: next to the JSON, .md].")
@click.option("--no-plots", is_flag=True, help="Do not write PNG plots even if matplotlib is installed.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--max-tokens", "-n", type=click.IntRange(min=2), default=None, help="Tokens generated per run [default: 128, quick 48].")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Timed repeats per measurement [default: 5, quick 3].")
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=None, help="k of the end-to-end comparison and scaling [default: 4].")
@click.option("--target-sizes", default=None, metavar="HxL,...", help="Synthetic target sizes for the size scaling, e.g. 512x8,1024x16 [default: up to 3072x24, quick 512x4].")
@click.option("--rerender", "rerender_path", type=click.Path(exists=True, dir_okay=False), default=None, help="Measure nothing: re-derive the cost model's figures from a saved JSON and rewrite it, its report and plots.")
@click.option("--tune", is_flag=True, help="Afterwards also run `mlx-spec tune` for the pair and store the calibration.")
@click.option("--smoke", is_flag=True, hidden=True, help="Seconds on tiny test models (tests only).")
@dequantize_option
@click.option("--distributed", is_flag=True, help="Under mlx.launch: the target sharded across the ranks, plain vs speculative tokens/s, its verify cost and the communication per pass.")
def bench(model, draft_model, quick, json_path, report_path, no_plots, seed, max_tokens,
          repeats, num_draft_tokens, target_sizes, rerender_path, tune, smoke, distributed,
          dequantize):
    """Measure bandwidth, verify cost, acceptance and speed-up; say whether speculation pays."""
    from ..bench.runner import BenchConfig, quick_config, run_bench, tiny_config
    from ..dflash import is_dflash_model
    from ..eagle3 import is_eagle3_head

    _check_writable(rerender_path or json_path, report_path)
    if distributed:
        if dequantize:
            raise click.UsageError("--dequantize applies to one machine's models, not a "
                                   "sharded target.")
        _distributed(model, draft_model, json_path, report_path, max_tokens, _progress())
        return
    if rerender_path:
        _write(_rerender(rerender_path), rerender_path, report_path, no_plots, click.echo)
        return
    model, draft_model = _resolve(model, draft_model)
    overrides = {name: value for name, value in (
        ("seed", seed), ("max_tokens", max_tokens), ("repeats", repeats),
        ("num_draft_tokens", num_draft_tokens)) if value is not None}
    if target_sizes:
        overrides["target_sizes"] = _parse_sizes(target_sizes)
    make = tiny_config if smoke else quick_config if quick else BenchConfig
    config = make(**overrides)

    say = _progress()
    say(f"loading {model} and {draft_model}")
    target_model, tokenizer, draft = load_pair(model, draft_model, no_draft=False,
                                               dequantize=dequantize)
    if is_dflash_model(draft):
        say("the draft is a DFlash block drafter: its pass per round is measured instead of a "
            "draft step, and the report says which phases do not apply")
    elif is_eagle3_head(draft):
        say("the draft is an EAGLE-3 head: its chained step is measured as the draft step, and "
            "the report says which phases do not apply")
    try:
        result = run_bench(target_model, draft, tokenizer, config,
                           models={"target": model, "draft": draft_model}, progress=say)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None

    _write(result, json_path, report_path, no_plots, say)
    if tune:
        _tune(target_model, draft, tokenizer, say)


def _progress():
    """A progress printer: each message to stderr after the seconds since this call."""
    start = time.perf_counter()

    def say(message):
        click.echo(f"[{time.perf_counter() - start:6.1f}s] {message}", err=True)

    return say


def _distributed(model, draft_model, json_path, report_path, max_tokens, say) -> None:
    """`mlx-spec bench --distributed`: load sharded, measure on every rank, rank 0 writes."""
    from ..distributed import launched_group, load_sharded
    from ..bench.distributed import DEFAULT_MAX_TOKENS, render_markdown, run_distributed_bench

    group = launched_group()
    if group is None:
        raise click.UsageError("--distributed measures a target sharded across ranks; run it "
                               "under mlx.launch with two or more ranks (mlx.launch -n 2 -- "
                               "mlx-spec bench --distributed).")
    model, draft_model = _resolve(model, draft_model)
    rank0 = group.rank() == 0
    say = say if rank0 else (lambda message: None)
    say(f"loading {model} sharded over {group.size()} ranks, and {draft_model} on each")
    try:
        target_model, tokenizer, draft = load_sharded(model, draft_model, group)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    result = run_distributed_bench(target_model, draft, tokenizer, group,
                                   {"target": model, "draft": draft_model},
                                   max_tokens or DEFAULT_MAX_TOKENS, say)
    if not rank0:
        return
    json_path = Path(json_path)
    json_path.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    report_path = Path(report_path) if report_path else json_path.with_suffix(".md")
    report_path.write_text(render_markdown(result))
    click.echo(render_markdown(result))
    click.echo(f"Wrote {json_path} and {report_path}.")


def _tune(target_model, draft, tokenizer, say):
    """Calibrate the pair (as `mlx-spec tune` does) and store it for the adaptive policy."""
    from ..calibration import save_calibration
    from ..bench.calibrate import calibrate

    say("calibrating the pair for the adaptive policy (mlx-spec tune)")
    path = save_calibration(calibrate(target_model, draft, tokenizer, progress=say))
    click.echo(f"Stored this machine's calibration for the pair in {path}.")


def _check_writable(*paths):
    """Refuse an output path that cannot be written before measuring for minutes, not after."""
    for path in filter(None, paths):
        parent = Path(path).absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.UsageError(f"Cannot write {path}: {exc.strerror}.") from None
        if not os.access(parent, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
            raise click.UsageError(f"Cannot write {path}: permission denied.")


def _rerender(json_path):
    from ..bench.runner import BenchResult, recompute_predictions
    from ..bench.serialize import from_dict

    try:
        saved = from_dict(BenchResult, json.loads(Path(json_path).read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise click.UsageError(f"{json_path} is not a bench result JSON ({exc}).") from None
    return recompute_predictions(saved)


def _write(result, json_path, report_path, no_plots, say):
    """Write the JSON, the Markdown report and plots; print the summary."""
    from ..bench import plots
    from ..bench.report import render_markdown, render_text

    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    report_path = Path(report_path) if report_path else json_path.with_suffix(".md")
    written = []
    if not no_plots:
        written, message = plots.write_plots(result, report_path.with_suffix(""))
        say(message)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    relative = [str(p.relative_to(report_path.parent)) for p in written]
    report_path.write_text(render_markdown(result, relative))
    click.echo(render_text(result))
    click.echo(f"\nWrote {json_path} and {report_path}"
               + (f" and {len(written)} plots" if written else "") + ".")
