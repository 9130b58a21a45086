"""`mlx-spec tune`: measure this machine's decoding costs and store them for the adaptive policy."""

from __future__ import annotations

import time

import click

from .models import load_pair
from .options import dequantize_option


@click.command()
@click.option("--model", "-m", default=None, help="Target model (default: the shipped pair).")
@click.option("--draft-model", "-d", default=None, help="Draft model (of the target's tokenizer or another), DFlash drafter or EAGLE-3 head directory to measure with it (default with the shipped target: the shipped draft).")
@click.option("--no-draft", is_flag=True, help="Measure the target alone.")
@click.option("--print", "show", is_flag=True, help="Show the stored calibration for the model; measure nothing.")
@click.option("--forget", is_flag=True, help="Delete the stored calibration for the model.")
@click.option("--mtp", is_flag=True, help="Also measure the target's own MTP layer (as generate --mtp drafts with it).")
@click.option("--mtp-weights", default=None, help="With --mtp: where its weights are (as for generate).")
@dequantize_option
def tune(model, draft_model, no_draft, show, forget, mtp, mtp_weights, dequantize):
    """Measure this machine's decoding costs (in seconds) and store them for the adaptive policy."""
    from .. import calibration
    from ..bench.calibrate import calibrate

    if show and forget:
        raise click.UsageError("Give --print or --forget, not both.")
    if mtp_weights is not None and not mtp:
        raise click.UsageError("--mtp-weights is only used with --mtp.")
    start = time.perf_counter()

    def say(message):
        click.echo(f"[{time.perf_counter() - start:5.1f}s] {message}", err=True)

    if not (show or forget):
        say("loading the models")
    target_model, tokenizer, draft = load_pair(model, draft_model, no_draft or forget,
                                               dequantize=dequantize)
    if forget:
        _forget_calibration(calibration, target_model)
    elif show:
        _show_calibration(calibration, target_model, draft)
    else:
        try:
            cal = calibrate(target_model, draft, tokenizer, progress=say, mtp=mtp,
                                        mtp_weights=mtp_weights)
        except ValueError as exc:  # the MTP layer: a family without one, missing weights
            raise click.UsageError(str(exc)) from None
        try:
            path = calibration.save_calibration(cal)
        except OSError as exc:
            raise click.UsageError(f"Cannot write the calibration under {calibration.cache_dir()}: "
                                   f"{exc.strerror}; set MLX_SPEC_CACHE_DIR to a writable "
                                   "directory.") from None
        say("done")
        click.echo(calibration.describe(cal, _fingerprint(calibration, draft)))
        click.echo(f"Wrote {path}.")


def _fingerprint(calibration, draft):
    from ..dflash import is_dflash_model
    from ..eagle3 import is_eagle3_head

    if is_dflash_model(draft):
        return calibration.dflash_key(draft)
    if is_eagle3_head(draft):
        return calibration.eagle3_key(draft)
    return calibration.model_fingerprint(draft) if draft is not None else None


def _forget_calibration(calibration, target_model):
    try:
        path = calibration.forget_calibration(target_model)
    except OSError as exc:
        raise click.UsageError(f"Cannot delete the calibration: {exc}.") from None
    click.echo(f"Deleted {path}." if path else "No calibration stored for this model.")


def _show_calibration(calibration, target_model, draft):
    try:
        cal = calibration.load_calibration(target_model)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if cal is None:
        click.echo("No calibration stored for this model on this machine, or it is stale "
                   f"(older than {calibration.MAX_AGE_DAYS} days or from another MLX version); "
                   "run `mlx-spec tune`.")
        return
    click.echo(calibration.describe(cal, _fingerprint(calibration, draft)))
    click.echo(f"Measured {time.strftime('%Y-%m-%d %H:%M', time.localtime(cal.created))}; "
               f"stored in {calibration.calibration_path(target_model)}.")
