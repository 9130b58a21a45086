"""`mlx-spec serve`: the OpenAI-compatible HTTP server (mlx_spec.server) from the command line."""

from __future__ import annotations

import importlib.util
import re
import signal
import sys

import click

from ..defaults import (DEFAULT_KV_GROUP_SIZE, DEFAULT_PREFILL_STEP_SIZE,
                        DEFAULT_QUANTIZED_KV_START, MLX_LM_PREFILL_STEP_SIZE)
from .generate import tree_shape
from .models import load_mtp_head, load_pair
from .options import (adapter_option, check_mtp, json_kwargs, model_options, mtp_options,
                      sampling_options, speculation_options, trust_option)

DEFAULT_MODEL_ID = "mlx-spec-default"  # what `serve` calls the shipped pair
SUFFIX_SCOPES = ("request", "key", "all")  # mlx_spec.server.suffix_scope.SCOPES (kept MLX-free here)


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


@click.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", default=None, envvar="MLX_SPEC_API_KEY", help="Require `Authorization: Bearer KEY` on every request (401 otherwise); also read from $MLX_SPEC_API_KEY.")
@click.option("--allowed-origins", default=None, help="Web pages whose scripts may call the server (CORS): origins such as http://localhost:3000, comma-separated, or * for any page (mlx-lm's option; mlx-lm allows any by default, this server none).")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=16, show_default=True, help="Requests admitted at once (queued + generating); more get 429.")
@click.option("--prompt-cache-bytes", type=ByteSize(), default="2GiB", show_default=True, help="Memory for prompt caches kept between requests (multi-turn reuse); 0 turns reuse off.")
@click.option("--decode-concurrency", type=click.IntRange(min=1), default=None, help="Batched: the most requests decoding together; the others admitted wait their turn (mlx-lm's option; default: every admitted request, up to --max-concurrency).")
@click.option("--prompt-cache-size", type=click.IntRange(min=1), default=None, help="The most prompt caches kept between requests, the least recently stored out first (mlx-lm's option; default: as many as --prompt-cache-bytes holds).")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=512, show_default=True, help="Token budget of a request that gives no max_tokens.")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=8192, show_default=True, help="The most max_tokens a request may ask for (400 beyond).")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=32768, show_default=True, help="The longest prompt a request may send, in tokens (400 beyond).")
@click.option("--max-body-bytes", type=ByteSize(), default="4MiB", show_default=True, help="The largest request body (413 beyond, before it is read).")
@sampling_options
@speculation_options
@mtp_options
@click.option("--suffix/--no-suffix", default=False, show_default=True, help="Suffix drafting for every request: draft from the text of earlier requests in the request's scope (a request's `suffix` field overrides).")
@click.option("--suffix-scope", type=click.Choice(SUFFIX_SCOPES), default="key", show_default=True, help="Whose earlier text a request drafts from: its own only (request), its API key's (key; a request without a key: its own), or every request's (all: a single-user server).")
@click.option("--suffix-file", type=click.Path(dir_okay=False), default=None, help="Load the suffix indexes from this file at start (if it exists) and save them there at shutdown.")
@click.option("--suffix-max-tokens", type=click.IntRange(min=1), default=None, help="Tokens the suffix indexes hold, all partitions together (default: the index's own budget, 1048576); least recently used first out.")
@click.option("--tree", default="auto", show_default=True, callback=lambda ctx, param, value: tree_shape(value), help="Token trees from the drafters that have them for every request, as generate --tree: DxW, off or auto (the policy's width: a request alone in the batch takes its policy's, rows beside others draft chains). A DxW tree is batched, each row its own tree (a draft of another tokenizer drafts chains beside lookup's tries, as for generate).")
@click.option("--batching/--no-batching", default=True, show_default=True, help="Decode all admitted requests together (continuous batching, speculating per row) where the models allow it (attention and sliding-window targets, the recurrent hybrids docs/serving.md lists: Qwen3.5, Qwen3-Next, LFM2, Nemotron-H, Granite 4.0-H, Falcon-H1, Jamba, ..., and Mamba, Mamba-2 and RWKV-7; a draft model of any tokenizer, the MTP head, an EAGLE-3 head, a DFlash or DFlash2 drafter, or none); --no-batching serves one request at a time.")
@adapter_option
@trust_option
@click.option("--chat-template", default=None, help="A chat template (Jinja) to use in place of the tokenizer's (mlx-lm's option).")
@click.option("--chat-template-args", default=None, callback=json_kwargs, help="A JSON object of keyword arguments for the chat template, e.g. '{\"enable_thinking\": false}' (mlx-lm's option); a request's chat_template_kwargs go over them.")
@click.option("--kv-bits", type=click.Choice(["2", "3", "4", "5", "6", "8"]), default=None, callback=lambda ctx, param, value: None if value is None else int(value), help="Quantize the target's KV cache to this many bits once it holds --quantized-kv-start tokens (mlx-lm's option): requests are then decoded one at a time, as mlx-lm's server decodes them. Default: no quantization.")
@click.option("--kv-group-size", type=click.Choice(["32", "64", "128"]), default=str(DEFAULT_KV_GROUP_SIZE), show_default=True, callback=lambda ctx, param, value: int(value), help="Group size for KV cache quantization.")
@click.option("--quantized-kv-start", type=click.IntRange(min=0), default=DEFAULT_QUANTIZED_KV_START, show_default=True, help="With --kv-bits: the number of tokens a request's cache holds when it is quantized.")
@click.option("--prefill-step-size", type=click.IntRange(min=1), default=None, help=f"Prompt tokens prefilled at a time (mlx-lm's option; default {DEFAULT_PREFILL_STEP_SIZE}, with --kv-bits {MLX_LM_PREFILL_STEP_SIZE}, mlx-lm's); the batch prefills this many between its rounds.")
@click.option("--verbose", "-v", is_flag=True, help="Log every request (uvicorn's access log).")
def serve(model, draft_model, no_draft, host, port, api_key, allowed_origins, max_concurrency,
          decode_concurrency, prompt_cache_bytes, prompt_cache_size, max_tokens,
          max_tokens_limit, max_prompt_tokens, max_body_bytes, temp, top_p, top_k, min_p,
          num_draft_tokens, adaptive, max_draft_tokens,
          no_auto_off, draft_confidence, prompt_lookup, prompt_lookup_max_ngram, calibration,
          mtp, mtp_weights, suffix, suffix_scope, suffix_file, suffix_max_tokens, tree, batching,
          adapter_path, trust_remote_code, chat_template, chat_template_args, kv_bits,
          kv_group_size, quantized_kv_start, prefill_step_size, verbose, dequantize):
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions).

    Options other than the model's and the suffix index's are defaults: a
    request may set its own sampling, max_tokens, num_draft_tokens,
    prompt_lookup and suffix.
    """
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise click.ClickException("mlx-spec serve needs its HTTP libraries; install them with "
                                   "pip install 'mlx-spec[serve]'.")
    check_mtp(mtp, mtp_weights, draft_model, no_draft)
    if suffix_file is not None and suffix_scope == "request":
        raise click.UsageError("--suffix-file keeps shared suffix indexes, and --suffix-scope "
                               "request shares nothing; use --suffix-scope key or all with it.")
    from ..loading import vocab_size
    from ..server.app import Limits, bind, create_app, make_server
    from ..server.cache_store import PromptCacheStore
    from ..server.requests import Settings
    from ..server.suffix_scope import SuffixScopes
    from ..server.worker import GenerationWorker, SpeculationOptions, can_batch

    model_id = model or DEFAULT_MODEL_ID
    budget = {} if suffix_max_tokens is None else {"max_tokens": suffix_max_tokens}
    try:  # the file before the models: a corrupt one is one sentence, at once
        scopes = SuffixScopes(suffix_scope, path=suffix_file, **budget)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    target_model, tokenizer, draft = load_pair(model, draft_model, no_draft or mtp,
                                               dequantize=dequantize, adapter_path=adapter_path,
                                               trust_remote_code=trust_remote_code)
    if mtp:
        draft = load_mtp_head(target_model, mtp_weights)
    try:
        scopes.check_vocabulary(vocab_size(target_model))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise click.ClickException(f"Cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                   "choose another --port or --host.") from None
    options = SpeculationOptions(adaptive=adaptive, max_draft_tokens=max_draft_tokens,
                                 auto_off=not no_auto_off, draft_confidence=draft_confidence,
                                 prompt_lookup_max_ngram=prompt_lookup_max_ngram,
                                 calibration="auto" if calibration else None,
                                 mtp_weights=mtp_weights, tree=tree, kv_bits=kv_bits,
                                 kv_group_size=kv_group_size,
                                 quantized_kv_start=quantized_kv_start,
                                 prefill_step_size=prefill_step_size)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    defaults = Settings(max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                        num_draft_tokens=num_draft_tokens, prompt_lookup=prompt_lookup,
                        suffix=suffix,
                        chat_template_kwargs=tuple((chat_template_args or {}).items()))
    store = (PromptCacheStore(prompt_cache_bytes, prompt_cache_size)
             if prompt_cache_bytes > 0 else None)
    batched = batching and kv_bits is None and can_batch(target_model, draft, tokenizer)
    try:
        worker = GenerationWorker(target_model, tokenizer, draft, options, store,
                                  max_concurrency, scopes, batching=batched,
                                  max_rows=decode_concurrency)
    except ValueError as exc:  # (--kv-group-size that does not divide the keys)
        raise click.UsageError(str(exc)) from None
    if max_tokens > max_tokens_limit:
        raise click.BadParameter(f"the default ({max_tokens}) is above --max-tokens-limit "
                                 f"({max_tokens_limit}).", param_hint="--max-tokens")
    limits = Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens_limit,
                    max_prompt_tokens=max_prompt_tokens)
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()] \
        if allowed_origins else []
    app = create_app(worker, model_id, defaults, api_key, limits, origins)
    if api_key is None and not _loopback(host):
        click.echo(f"Warning: listening on {host} without --api-key: anyone who can reach this "
                   "address can use the model.", err=True)
    server = make_server(app, "info" if verbose else "warning")
    address = f"[{host}]" if ":" in host else host
    drafting = ("no draft" if draft is None else "the target's MTP head" if mtp
                else f"draft {draft_model or 'the shipped one'}")
    drafting += ", batched" if batched else ", one request at a time"
    if kv_bits is not None:
        drafting += f", KV cache quantized to {kv_bits} bits from {quantized_kv_start} tokens"
    click.echo(f"Serving {model_id} ({drafting}) at http://{address}:{sock.getsockname()[1]}/v1; "
               "Ctrl-C stops it.", err=True)
    signal.signal(signal.SIGTERM, _terminated)  # uvicorn shuts down, then raises it again
    server.run(sockets=[sock])


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _terminated(signum, frame):
    sys.exit(0)
