"""What the commands share: option groups, the seed range, reading a prompt, the chat template."""

from __future__ import annotations

import os
import sys

import click

from ..arguments import SEED_LIMIT
from ..defaults import (DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_NGRAM, DEFAULT_NUM_DRAFT_TOKENS)

SEED = click.IntRange(0, SEED_LIMIT - 1)  # what mx.random.seed accepts


def read_prompt(prompt: str) -> str:
    """The prompt text; bytes that are not UTF-8 become U+FFFD, with a one-line warning. On
    the command line `\\n` and `\\t` are a newline and a tab, as mlx-lm's generate reads them
    (standard input is read as it is)."""
    if prompt == "-":
        raw = sys.stdin.buffer.read()
    else:  # on Linux, undecodable bytes in argv arrive as surrogate escapes
        prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
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


def apply_chat_template(tokenizer, prompt: str, template_kwargs=None, system_prompt=None,
                        prefill_response=None) -> str:
    """The prompt in the tokenizer's chat template, as mlx-lm's generate puts it: a system
    message first, the answer begun with `prefill_response` (the template continues it)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
        [{"role": "user", "content": prompt}]
    prefilled = prefill_response is not None
    if prefilled:
        messages.append({"role": "assistant", "content": prefill_response})
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=not prefilled,
                                         continue_final_message=prefilled,
                                         **(template_kwargs or {}))


def json_kwargs(ctx, param, value):
    """A JSON object of keyword arguments for the chat template (mlx-lm's --chat-template-args
    and --chat-template-config), checked; None when not given."""
    import json

    if value is None:
        return None
    from ..server.requests import RequestError, template_kwargs

    try:
        return template_kwargs(json.loads(value), param.opts[0])
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON ({exc.msg} at character {exc.pos}); write an "
                                 "object such as '{\"enable_thinking\": false}'.") from None
    except RequestError as exc:
        raise click.BadParameter(str(exc)) from None


def options(*decorators):
    """One decorator applying several click options, so commands share them."""
    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command
    return apply


trust_option = click.option("--trust-remote-code", is_flag=True, help="Let the models' tokenizers run their own code from their repositories (mlx-lm's option).")
adapter_option = click.option("--adapter-path", type=click.Path(file_okay=False), default=None, help="The target's fine-tuned adapters: the directory mlx_lm.lora wrote (mlx-lm's option; a GGUF target takes them too).")
dequantize_option = click.option("--dequantize", is_flag=True, help="GGUF files: keep their quantized matrices as floats (float32 on the CPU) instead of MLX's quantized formats: larger, and faster where float matmuls go through BLAS (a Linux CPU with OpenBLAS); on a Mac's GPU quantized weights are faster.")
model_options = options(
    click.option("--model", "-m", default=None, help="Target model: local directory or Hugging Face repo id (default: the shipped pair)."),
    click.option("--draft-model", "-d", default=None, help="Draft model: local directory or repo id sharing the target's tokenizer."),
    click.option("--no-draft", is_flag=True, help="No draft model: the target drafts only by prompt lookup (on by default); with --no-prompt-lookup too it decodes alone (the baseline)."),
    dequantize_option,
)
sampling_options = options(
    click.option("--temp", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="Sampling temperature; 0 is greedy."),
    click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True),
    click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables top-k."),
    click.option("--min-p", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.0, show_default=True),
)
mtp_options = options(
    click.option("--mtp", is_flag=True, help="Draft with the target's own multi-token-prediction layer (Qwen3-Next, Qwen3.5, DeepSeek-V3, GLM-4.5, or a head trained for the target, as the shipped default's) instead of a draft model."),
    click.option("--mtp-weights", default=None, help="With --mtp: a directory or Hugging Face repo id of the original checkpoint holding the MTP weights (default: the model's own directory)."),
)
speculation_options = options(
    click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=None, help=f"Pin the tokens drafted per round (default: adaptive k; fixed k={DEFAULT_NUM_DRAFT_TOKENS} with --fixed, or with --seed at --temp > 0 so seeded runs repeat)."),
    click.option("--adaptive/--fixed", default=None, help="Choose k each round from measured acceptance and cost, switching speculation off when it loses (the default)."),
    click.option("--max-draft-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_DRAFT_TOKENS, show_default=True, help="Largest k the adaptive policy may choose."),
    click.option("--no-auto-off", is_flag=True, help="Adaptive policy: never fall back to plain decoding."),
    click.option("--draft-confidence", type=click.FloatRange(min=0.0, max=1.0, max_open=True), default=0.0, show_default=True, help="Stop drafting when the draft's top probability falls below this."),
    click.option("--prompt-lookup/--no-prompt-lookup", default=None, help="Draft by n-gram lookup in the prompt and output so far, kept while the adaptive policy finds it pays (default: on at every --temp, except in front of a draft model, MTP head or DFlash drafter, or with --seed, at --temp > 0)."),
    click.option("--prompt-lookup-max-ngram", type=click.IntRange(min=1), default=DEFAULT_MAX_NGRAM, show_default=True),
    click.option("--calibration/--no-calibration", default=True, show_default=True, help="Start the adaptive policy from this machine's stored `mlx-spec tune` measurements, if any."),
)


def check_mtp(mtp: bool, mtp_weights, draft_model, no_draft: bool) -> None:
    """One sentence for --mtp / --mtp-weights combined with flags they exclude."""
    if mtp and (draft_model is not None or no_draft):
        raise click.UsageError("--mtp drafts with the target itself; drop --draft-model / --no-draft.")
    if mtp_weights is not None and not mtp:
        raise click.UsageError("--mtp-weights is only used with --mtp.")
