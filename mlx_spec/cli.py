"""The `mlx-spec` command line: parses flags, calls the Python API, prints. No maths here.

Importing it imports no MLX (the commands import the API when they run), so
`--help` and `--version` answer at once. Every bad input is one line and a
non-zero exit; `console.main`, the installed script, adds Ctrl-C handling.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import sys
import time

import click

from . import __version__
from .arguments import SEED_LIMIT
from .defaults import (DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_NGRAM, DEFAULT_MAX_TOKENS,
                       DEFAULT_NUM_DRAFT_TOKENS)

SOURCE_COLORS = {"draft": "green", "lookup": "cyan", "mtp": "green"}
SEED = click.IntRange(0, SEED_LIMIT - 1)  # what mx.random.seed accepts
DEFAULT_MODEL_ID = "mlx-spec-default"  # what `serve` calls the shipped pair


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="mlx-spec")
def main():
    """Exact speculative decoding on MLX: a draft proposes, the target verifies."""


def _read_prompt(prompt: str) -> str:
    """The prompt text; bytes that are not UTF-8 become U+FFFD, with a one-line warning."""
    if prompt == "-":
        raw = sys.stdin.buffer.read()
    else:  # on Linux, undecodable bytes in argv arrive as surrogate escapes
        try:
            raw = os.fsencode(prompt)
        except UnicodeEncodeError:  # a lone surrogate that no byte produced
            raw = prompt.encode("utf-8", "surrogatepass")
    try:
        prompt = raw.decode("utf-8")
    except UnicodeDecodeError:
        prompt = raw.decode("utf-8", "replace")
        click.echo("Warning: the prompt is not valid UTF-8; undecodable bytes were replaced "
                   "with U+FFFD.", err=True)
    if not prompt.strip():
        raise click.UsageError("The prompt is empty; pass --prompt TEXT (or --prompt - for stdin).")
    return prompt


def _load(path, role):
    from .loading import load

    try:
        return load(path)
    except ValueError as exc:
        raise click.UsageError(f"Cannot load the {role} model: {exc}") from None


def _apply_chat_template(tokenizer, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _resolve_models(model, draft_model, no_draft):
    """Default: the shipped pair. --model alone decodes with no draft unless one is given."""
    from .loading import default_draft_path, default_target_path

    if model is None:
        if not (default_target_path() / "config.json").exists():
            raise click.UsageError(
                "No --model given and the default models are not installed; pass --model PATH."
            )
        model = str(default_target_path())
        if draft_model is None:
            draft_model = str(default_draft_path())
    return model, (None if no_draft else draft_model)


def _options(*decorators):
    """One decorator applying several click options, so commands share them."""
    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command
    return apply


_model_options = _options(
    click.option("--model", "-m", default=None, help="Target model: local directory or Hugging Face repo id (default: the shipped pair)."),
    click.option("--draft-model", "-d", default=None, help="Draft model: local directory or repo id sharing the target's tokenizer."),
    click.option("--no-draft", is_flag=True, help="Decode with the target alone (the baseline)."),
)
_sampling_options = _options(
    click.option("--temp", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="Sampling temperature; 0 is greedy."),
    click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True),
    click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables top-k."),
    click.option("--min-p", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.0, show_default=True),
)
_speculation_options = _options(
    click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=None, help=f"Pin the tokens drafted per round (default: adaptive k; fixed k={DEFAULT_NUM_DRAFT_TOKENS} with --fixed, or with --seed at --temp > 0 so seeded runs repeat)."),
    click.option("--adaptive/--fixed", default=None, help="Choose k each round from measured acceptance and cost, switching speculation off when it loses (the default)."),
    click.option("--max-draft-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_DRAFT_TOKENS, show_default=True, help="Largest k the adaptive policy may choose."),
    click.option("--no-auto-off", is_flag=True, help="Adaptive policy: never fall back to plain decoding."),
    click.option("--draft-confidence", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.0, show_default=True, help="Stop drafting when the draft's top probability falls below this."),
    click.option("--prompt-lookup/--no-prompt-lookup", default=None, help="Draft by n-gram lookup in the prompt and output so far (default: on in front of a draft model at --temp 0; off otherwise)."),
    click.option("--prompt-lookup-max-ngram", type=click.IntRange(min=1), default=DEFAULT_MAX_NGRAM, show_default=True),
    click.option("--calibration/--no-calibration", default=True, show_default=True, help="Start the adaptive policy from this machine's stored `mlx-spec tune` measurements, if any."),
)


@main.command()
@_model_options
@click.option("--prompt", "-p", default="def fibonacci(n):", show_default=True, help="Prompt text, or - to read standard input.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True)
@_sampling_options
@_speculation_options
@click.option("--seed", type=SEED, default=None, help="Random seed for reproducible sampling.")
@click.option("--ignore-chat-template", is_flag=True, help="Feed the prompt as is, even if the tokenizer has a chat template.")
@click.option("--color", is_flag=True, help="Colour tokens by source: green = draft model or MTP layer, cyan = prompt lookup.")
@click.option("--quiet", "-q", is_flag=True, help="Do not print the stats.")
@click.option("--mtp", is_flag=True, help="Draft with the target's own multi-token-prediction layer (Qwen3-Next, Qwen3.5, DeepSeek-V3, GLM-4.5, or a head trained for the target, as the shipped default's) instead of a draft model.")
@click.option("--mtp-weights", default=None, help="With --mtp: a directory or Hugging Face repo id of the original checkpoint holding the MTP weights (default: the model's own directory).")
@click.option("--sharding", type=click.Choice(["auto", "tensor", "pipeline"]), default="auto", show_default=True, help="Under mlx.launch with several ranks: split the target by tensor parallelism or pipeline stages (auto: tensor when the model class allows).")
def generate(model, draft_model, prompt, max_tokens, temp, top_p, top_k, min_p,
             num_draft_tokens, adaptive, max_draft_tokens, no_auto_off, draft_confidence,
             seed, no_draft, prompt_lookup, prompt_lookup_max_ngram,
             ignore_chat_template, color, calibration, quiet, mtp, mtp_weights, sharding):
    """Generate text, streaming it to stdout; stats go to stderr."""
    from .generate import stream_generate

    prompt = _read_prompt(prompt)
    if mtp and (draft_model is not None or no_draft):
        raise click.UsageError("--mtp drafts with the target itself; drop --draft-model / --no-draft.")
    if mtp_weights is not None and not mtp:
        raise click.UsageError("--mtp-weights is only used with --mtp.")
    group = _launched_group()  # None unless mlx.launch started several ranks
    if group is None and sharding != "auto":
        raise click.UsageError("--sharding only applies under mlx.launch with two or more ranks.")
    if group is None:
        target_model, tokenizer, draft = _load_pair(model, draft_model, no_draft or mtp)
    else:
        target_model, tokenizer, draft = _load_sharded(model, draft_model, no_draft or mtp,
                                                       group, sharding)
    if not ignore_chat_template:
        prompt = _apply_chat_template(tokenizer, prompt)
    shown = group is None or group.rank() == 0  # only rank 0 prints text and stats

    response = None
    try:
        for response in stream_generate(
            target_model, tokenizer, prompt, draft_model="mtp" if mtp else draft,
            max_tokens=max_tokens,
            num_draft_tokens=num_draft_tokens, adaptive=adaptive,
            max_draft_tokens=max_draft_tokens, auto_off=not no_auto_off,
            draft_confidence=draft_confidence, temp=temp, top_p=top_p, top_k=top_k,
            min_p=min_p, seed=seed, prompt_lookup=prompt_lookup,
            prompt_lookup_max_ngram=prompt_lookup_max_ngram,
            calibration="auto" if calibration else None, mtp_weights=mtp_weights,
        ):
            fg = SOURCE_COLORS.get(response.source) if color else None
            text = click.style(response.text, fg=fg) if fg else response.text
            if shown:
                click.echo(text, nl=False, color=True if color else None)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not shown:
        return
    click.echo()
    if response is not None and not quiet:
        click.echo("=" * 10, err=True)
        click.echo(response.stats.summary(), err=True)


def _launched_group():
    from .distributed import launched_group

    return launched_group()


def _load_sharded(model, draft_model, no_draft, group, sharding):
    """Under mlx.launch: the target sharded across the ranks, the draft whole on each."""
    from .distributed import load_sharded

    model, draft_model = _resolve_models(model, draft_model, no_draft)
    try:
        return load_sharded(model, draft_model, group, sharding)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def _load_pair(model, draft_model, no_draft):
    """Load the target (and the draft unless there is none); refuse mismatched pairs."""
    from .loading import check_pair

    model, draft_model = _resolve_models(model, draft_model, no_draft)
    target_model, tokenizer = _load(model, "target")
    if draft_model is None:
        return target_model, tokenizer, None
    draft, draft_tokenizer = _load(draft_model, "draft")
    try:
        check_pair(target_model, draft, tokenizer, draft_tokenizer)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return target_model, tokenizer, draft


@main.command()
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
@click.option("--negative-control", is_flag=True, help="Also run a deliberately broken rule, to show the check can fail.")
@click.option("--seed", type=SEED, default=0, show_default=True)
def check(model, draft_model, prompt, samples, temp, top_p, top_k, min_p, num_draft_tokens,
          prompt_lookup, negative_control, seed):
    """Statistically check that speculation leaves the output distribution unchanged.

    Samples the first two tokens SAMPLES times with speculation and compares them
    with the target's exact distribution (chi-square). Exits 1 if they differ.
    """
    from .acceptance import resample_from_target_accept
    from .exactness import check_exactness
    from .sampling import SamplingConfig

    prompt = _read_prompt(prompt)
    target_model, tokenizer, draft = _load_pair(model, draft_model, False)
    if draft is None and not prompt_lookup:
        raise click.UsageError("Give --draft-model or --prompt-lookup: there is nothing to check.")
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
                                     prompt_lookup=prompt_lookup, seed=seed)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        verdict = "indistinguishable from the target" if result.passed else "DIFFERS from the target"
        click.echo(f"{name}: chi2 = {result.statistic:.1f} on {result.dof} dof, "
                   f"p = {result.p_value:.3g}, acceptance {result.acceptance_rate:.1%} -> {verdict}")
        failed |= accept is None and not result.passed
    if failed:
        sys.exit(1)


@main.command()
@click.option("--model", "-m", default=None, help="Target model (default: the shipped pair).")
@click.option("--draft-model", "-d", default=None, help="Draft model to measure with it (default with the shipped target: the shipped draft).")
@click.option("--no-draft", is_flag=True, help="Measure the target alone.")
@click.option("--print", "show", is_flag=True, help="Show the stored calibration for the model; measure nothing.")
@click.option("--forget", is_flag=True, help="Delete the stored calibration for the model.")
@click.option("--mtp", is_flag=True, help="Also measure the target's own MTP layer (as generate --mtp drafts with it).")
@click.option("--mtp-weights", default=None, help="With --mtp: where its weights are (as for generate).")
def tune(model, draft_model, no_draft, show, forget, mtp, mtp_weights):
    """Measure this machine's decoding costs (in seconds) and store them for the adaptive policy."""
    from . import calibration

    if show and forget:
        raise click.UsageError("Give --print or --forget, not both.")
    if mtp_weights is not None and not mtp:
        raise click.UsageError("--mtp-weights is only used with --mtp.")
    start = time.perf_counter()

    def say(message):
        click.echo(f"[{time.perf_counter() - start:5.1f}s] {message}", err=True)

    if not (show or forget):
        say("loading the models")
    target_model, tokenizer, draft = _load_pair(model, draft_model, no_draft or forget)
    if forget:
        _forget_calibration(calibration, target_model)
    elif show:
        _show_calibration(calibration, target_model, draft)
    else:
        try:
            cal = calibration.calibrate(target_model, draft, tokenizer, progress=say, mtp=mtp,
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


class ByteSize(click.ParamType):
    """A size in bytes: 2147483648, 2GiB, 512MiB, 1.5GB (binary with i, decimal without)."""

    name = "bytes"
    UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(value), re.IGNORECASE)
        if match is None:
            self.fail(f"{value!r} is not a size; write it as 2147483648, 2GiB or 512MiB.", param, ctx)
        return int(float(match.group(1)) * self.UNITS[(match.group(2) or "").lower()])


@main.command()
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", default=None, envvar="MLX_SPEC_API_KEY", help="Require `Authorization: Bearer KEY` on every request (401 otherwise); also read from $MLX_SPEC_API_KEY.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=16, show_default=True, help="Requests admitted at once (queued + generating); more get 429.")
@click.option("--prompt-cache-bytes", type=ByteSize(), default="2GiB", show_default=True, help="Memory for prompt caches kept between requests (multi-turn reuse); 0 turns reuse off.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=512, show_default=True, help="Token budget of a request that gives no max_tokens.")
@_sampling_options
@_speculation_options
@click.option("--verbose", "-v", is_flag=True, help="Log every request (uvicorn's access log).")
def serve(model, draft_model, no_draft, host, port, api_key, max_concurrency, prompt_cache_bytes,
          max_tokens, temp, top_p, top_k, min_p, num_draft_tokens, adaptive, max_draft_tokens,
          no_auto_off, draft_confidence, prompt_lookup, prompt_lookup_max_ngram, calibration,
          verbose):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions).

    Options other than the model's are defaults: a request may set its own
    sampling, max_tokens, num_draft_tokens and prompt_lookup.
    """
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise click.ClickException("mlx-spec serve needs its HTTP libraries; install them with "
                                   "pip install 'mlx-spec[serve]'.")
    from .server.app import bind, create_app, make_server
    from .server.cache_store import PromptCacheStore
    from .server.requests import Settings
    from .server.worker import GenerationWorker, SpeculationOptions

    model_id = model or DEFAULT_MODEL_ID
    target_model, tokenizer, draft = _load_pair(model, draft_model, no_draft)
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise click.ClickException(f"Cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                   "choose another --port or --host.") from None
    options = SpeculationOptions(adaptive=adaptive, max_draft_tokens=max_draft_tokens,
                                 auto_off=not no_auto_off, draft_confidence=draft_confidence,
                                 prompt_lookup_max_ngram=prompt_lookup_max_ngram,
                                 calibration="auto" if calibration else None)
    defaults = Settings(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                        num_draft_tokens=num_draft_tokens, prompt_lookup=prompt_lookup)
    store = PromptCacheStore(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
    worker = GenerationWorker(target_model, tokenizer, draft, options, store, max_concurrency)
    app = create_app(worker, model_id, defaults, api_key)
    server = make_server(app, "info" if verbose else "warning")
    address = f"[{host}]" if ":" in host else host
    drafting = "no draft" if draft is None else f"draft {draft_model or 'the shipped one'}"
    click.echo(f"Serving {model_id} ({drafting}) at http://{address}:{sock.getsockname()[1]}/v1; "
               "Ctrl-C stops it.", err=True)
    signal.signal(signal.SIGTERM, _terminated)  # uvicorn shuts down, then raises it again
    server.run(sockets=[sock])


def _terminated(signum, frame):
    sys.exit(0)


from .bench.cli import bench  # noqa: E402

main.add_command(bench)

if __name__ == "__main__":
    from .console import main as console_main

    console_main()
