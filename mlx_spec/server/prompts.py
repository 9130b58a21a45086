"""Messages or a prompt -> the token ids the model continues.

Chat: the tokenizer's chat template with the generation prompt, when it has
one. Without one (the shipped pair has none) the fallback format below, each
piece encoded on its own so that a conversation's next turn starts with the
same ids as the last one ended (the prompt cache store matches ids exactly):

    System: {content}\\n
    User: {content}\\n
    Assistant:{content}<eos>\\n       (a turn the assistant already gave)
    Assistant:                        (the generation prompt)

The role is the message's, capitalised. An assistant turn is closed by the
end-of-sequence token, as the model ended it (one that stopped at the token
limit is still a prefix of this, so its cache is reused as well). A request's
`chat_template_kwargs` (over the server's `--chat-template-args`) go to the
tokenizer's template.

Completions: text is encoded as `stream_generate` encodes it; token ids are
used as given, once they are checked against the vocabulary.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from .requests import RequestError

ASSISTANT = "assistant"


def chat_prompt_ids(tokenizer, messages: Sequence[Dict[str, str]],
                    template_kwargs: Optional[Dict[str, Any]] = None) -> List[int]:
    """The ids of `messages` followed by the assistant's generation prompt; `template_kwargs`
    go to the chat template (mlx-lm's chat_template_kwargs, e.g. {"enable_thinking": false});
    the fallback format has none to read them."""
    if getattr(tokenizer, "chat_template", None) is None:
        return _fallback_ids(tokenizer, messages)
    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                            tokenize=True, **(template_kwargs or {}))
    except Exception as exc:  # jinja raises its own errors for roles a template refuses
        raise RequestError(400, f"The model's chat template refused these messages: {exc}",
                           "messages", "invalid_value") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _fallback_ids(tokenizer, messages) -> List[int]:
    eos = _eos_id(tokenizer)
    ids: List[int] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == ASSISTANT:
            ids += _encode(tokenizer, "Assistant:", first=not ids) + _encode(tokenizer, content)
            ids += ([eos] if eos is not None else []) + _encode(tokenizer, "\n")
        else:
            ids += _encode(tokenizer, f"{role.capitalize()}: {content}\n", first=not ids)
    return ids + _encode(tokenizer, "Assistant:", first=not ids)


def _encode(tokenizer, text: str, first: bool = False) -> List[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=first))


def _eos_id(tokenizer) -> Optional[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = next(iter(sorted(getattr(tokenizer, "eos_token_ids", ()) or ())), None)
    return eos


def completion_prompt_ids(tokenizer, prompt: Union[str, Sequence[int]], vocab_size: int) -> List[int]:
    """The ids of a completion prompt: text encoded as stream_generate does, or ids checked."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        ids = list(tokenizer.encode(prompt, add_special_tokens=bos is None
                                    or not prompt.startswith(bos)))
    else:
        ids = list(prompt)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(400, f"prompt holds token id {bad}, outside the model's "
                                    f"vocabulary (0..{vocab_size - 1}).", "prompt", "invalid_value")
    if not ids:
        raise RequestError(400, "The prompt encodes to no tokens; give some text.", "prompt",
                           "invalid_value")
    return ids


def check_context(ids: Sequence[int], context_length: Optional[int], max_tokens: int,
                  param: str) -> int:
    """The token budget that fits the context; a prompt that fills it is refused."""
    if context_length is None:
        return max_tokens
    if len(ids) >= context_length:
        raise RequestError(400, f"The prompt is {len(ids)} tokens long; the model's context is "
                                f"{context_length} tokens. Shorten the prompt.", param,
                           "context_length_exceeded")
    return min(max_tokens, context_length - len(ids))


def context_length(model) -> Optional[int]:
    """The model's context from its config (max_position_embeddings), if it says."""
    size = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return int(size) if isinstance(size, int) and size > 0 else None
