"""The one model resolver of the command line: flags -> loaded models, or one UsageError sentence.

With no --model every command uses the shipped pair; --model alone decodes
with no draft unless one is given; a draft of another tokenizer drafts across it. MLX
and the models are imported when a command runs, never at `--help`.
"""

from __future__ import annotations

import click


def load_model(path, role, dequantize: bool = False, adapter_path=None,
               trust_remote_code: bool = False):
    """Load one model; a GGUF file's conversion is reported on stderr in one line.
    `dequantize`: a GGUF file's quantized matrices stay floats (other models: no effect);
    `adapter_path`: mlx-lm's fine-tuned adapters, applied to it; `trust_remote_code`: its
    tokenizer's own code may run (mlx-lm's option; a GGUF file has none)."""
    from ..loading import gguf_report, load

    gguf = is_gguf(path)
    options = {"dequantize": True} if dequantize and gguf else {}
    if adapter_path is not None:
        options["adapter_path"] = adapter_path
    if trust_remote_code and not gguf:
        options["trust_remote_code"] = True
    try:
        model, tokenizer = load(path, **options)
    except ValueError as exc:
        raise click.UsageError(f"Cannot load the {role} model: {exc}") from None
    report = gguf_report(model)
    if report is not None:
        click.echo(f"[{role}] {report.summary()}", err=True)
    return model, tokenizer


def is_gguf(path) -> bool:
    from ..gguf.reader import find_gguf

    try:
        return path is not None and find_gguf(str(path)) is not None
    except ValueError:  # a directory of several GGUF files: loading says so
        return False


def check_dequantize(dequantize: bool, *paths) -> None:
    """One sentence for --dequantize where no model given is a GGUF file."""
    if dequantize and not any(is_gguf(p) for p in paths):
        raise click.UsageError("--dequantize reads GGUF files, and neither model given is one.")


def resolve_models(model, draft_model, no_draft):
    """Default: the shipped pair. --model alone decodes with no draft unless one is given."""
    from ..loading import default_draft_path, default_target_path

    if model is None:
        if not (default_target_path() / "config.json").exists():
            raise click.UsageError(
                "No --model given and the default models are not installed; pass --model PATH."
            )
        model = str(default_target_path())
        if draft_model is None:
            draft_model = str(default_draft_path())
    return model, (None if no_draft else draft_model)


def load_pair(model, draft_model, no_draft, dequantize: bool = False, adapter_path=None,
              trust_remote_code: bool = False):
    """Load the target (and the draft unless there is none); a draft of another tokenizer
    drafts across it (said on stderr), a draft that does not fit is refused. `adapter_path`:
    the target's fine-tuned adapters (mlx-lm's --adapter-path; the draft has none).

    A draft directory holding a DFlash drafter (config.json: DFlashDraftModel) or an EAGLE-3
    head (any of its three published layouts) loads as one, checked to fit the target."""
    from ..dflash import check_fits, dflash_directory, load_dflash
    from ..eagle3 import eagle3_directory
    from ..assemble import draft_bridge
    from ..loading import check_pair

    model, draft_model = resolve_models(model, draft_model, no_draft)
    check_dequantize(dequantize, model, draft_model)
    target_model, tokenizer = load_model(model, "target", dequantize, adapter_path,
                                         trust_remote_code)
    if draft_model is None:
        return target_model, tokenizer, None
    if dflash_directory(draft_model) is not None:
        try:
            drafter = load_dflash(draft_model)
            check_fits(drafter, target_model)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        return target_model, tokenizer, drafter
    if eagle3_directory(draft_model) is not None:
        return target_model, tokenizer, _eagle3_head(draft_model, target_model)
    draft, draft_tokenizer = load_model(draft_model, "draft", dequantize,
                                        trust_remote_code=trust_remote_code)
    try:
        bridge = draft_bridge(target_model, draft, tokenizer, draft_tokenizer)
        if bridge is None:
            check_pair(target_model, draft, tokenizer, draft_tokenizer)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if bridge is not None:  # `load` keeps its tokenizer with it: the API finds it there
        click.echo(f"[draft] another tokenizer than the target's: drafting across it "
                   f"({bridge.shared} of the target's {bridge.target.size} tokens have a twin)",
                   err=True)
    return target_model, tokenizer, draft


def _eagle3_head(path, target_model):
    """The EAGLE-3 head in `path`, checked to fit the target."""
    from ..eagle3 import check_fits, load_eagle3

    try:
        head = load_eagle3(path)
        check_fits(head, target_model)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return head


def load_mtp_head(target_model, mtp_weights) -> str:
    """Load the target's MTP head now (kept on the model), so that weights that are missing or
    do not fit are one sentence at start; returns "mtp", the draft_model that names it."""
    from ..mtp import load_mtp

    try:
        load_mtp(target_model, mtp_weights)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    return "mtp"


def launched_group():
    from ..distributed import launched_group

    return launched_group()


def load_sharded(model, draft_model, no_draft, group, sharding):
    """Under mlx.launch: the target sharded across the ranks, the draft whole on each."""
    from ..distributed import load_sharded

    model, draft_model = resolve_models(model, draft_model, no_draft)
    try:
        return load_sharded(model, draft_model, group, sharding)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
