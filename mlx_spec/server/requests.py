"""A request body -> a checked `GenerationRequest`, or a `RequestError` that says what is wrong.

Pure: no MLX, no HTTP library. Ranges and types are the API's own
(`mlx_spec.arguments.check_arguments`), reported under the request's field
names (`temperature`, not `temp`). A field that is absent or null takes the
server's default (`Settings`, from the `serve` command line). `suffix` (true or
false) turns suffix drafting on or off (a text suffix, OpenAI's insertion, is
refused); whose text it drafts from is the server's choice. `logit_bias`,
`presence_penalty`, `frequency_penalty` and `repetition_penalty` become logits
processors (worker.py). A chat request's `chat_template_kwargs` go to the chat template,
over the server's `--chat-template-args`. Fields that would change the answer and are not
supported (`tools`, `response_format` other than text, `n` > 1, ...) are
refused with one sentence; fields that change nothing here (`user`,
`metadata`, ...) are ignored. `num_draft_tokens` is clamped to the package's
maximum (it sizes caches, so it must stay small).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple, Union

from ..arguments import check_arguments
from ..defaults import DEFAULT_XTC_THRESHOLD

# status -> OpenAI's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               403: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error",
               429: "requests", 500: "server_error", 503: "server_error"}
DEFAULT_MODEL_ALIAS = "default"
DEFAULT_DRAFT_ALIAS = "default_model"  # mlx-lm's server's name for the draft it serves

# request field -> the API argument it is checked as
SAMPLING_FIELDS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "seed": "seed", "num_draft_tokens": "num_draft_tokens",
                   "prompt_lookup": "prompt_lookup", "xtc_probability": "xtc_probability",
                   "xtc_threshold": "xtc_threshold"}


class RequestError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error")


@dataclass(frozen=True)
class Settings:
    """How to generate: the server's defaults (the `serve` flags), or a request's values over them."""

    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    num_draft_tokens: Optional[int] = None
    prompt_lookup: Optional[bool] = None
    suffix: bool = False  # suffix drafting from the scope's index (server/suffix_scope.py)
    logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, bias) pairs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None
    # mlx-lm's XTC sampling (off at 0): the request's rows drawn by mlx-lm's own sampler
    xtc_probability: float = 0.0
    xtc_threshold: float = DEFAULT_XTC_THRESHOLD
    # how many of the last tokens each penalty looks at (mlx-lm's request fields and defaults)
    repetition_context_size: int = 20
    presence_context_size: int = 20
    frequency_context_size: int = 20
    # the chat template's keyword arguments (mlx-lm's --chat-template-args, then a request's
    # chat_template_kwargs over them): (name, JSON value) pairs
    chat_template_kwargs: Tuple[Tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """One checked request: what to continue, how to generate, how to answer."""

    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    settings: Settings = Settings()
    messages: Tuple[Dict[str, str], ...] = ()  # role and content, both strings
    prompt: Union[str, Tuple[int, ...]] = ""  # text, or token ids
    stop: Tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # alternatives to report per token (None: no logprobs at all)


def parse_request(body: Any, chat: bool, model_id: str,
                  defaults: Settings = Settings()) -> GenerationRequest:
    """Check a decoded JSON body for /v1/chat/completions (`chat`) or /v1/completions."""
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.")
    _check_model(body.get("model"), model_id)
    if body.get("n") not in (None, 1):
        raise RequestError(400, "Only n = 1 is supported: one answer per request.", "n")
    _refuse_unsupported(body)
    given: Dict[str, Any] = {"max_tokens": _max_tokens(body, defaults)}
    for field, argument in SAMPLING_FIELDS.items():
        if body.get(field) is not None:
            _check(argument, body[field], field)
            given[argument] = body[field]
    if given.get("xtc_probability") and given.get("seed") is not None and \
            given.get("temp", defaults.temp) > 0:  # (at T = 0 XTC is off: greedy)
        raise RequestError(400, "seed does not fix XTC sampling's draws here (mlx-lm's XTC "
                                "sampler draws from MLX's global random state, which requests "
                                "share); leave one of them out.", "seed", "invalid_value")
    if given.get("num_draft_tokens") is not None:
        given["num_draft_tokens"] = min(given["num_draft_tokens"], MAX_NUM_DRAFT_TOKENS)
    given.update(_penalties(body))
    if body.get("suffix") is not None:
        given["suffix"] = _suffix(body["suffix"])
    if chat and body.get("chat_template_kwargs") is not None:
        given["chat_template_kwargs"] = tuple({
            **dict(defaults.chat_template_kwargs),
            **template_kwargs(body["chat_template_kwargs"], "chat_template_kwargs")}.items())
    fields: Dict[str, Any] = {"chat": chat, "settings": replace(defaults, **given)}
    if chat:
        fields["messages"] = _messages(body.get("messages"))
    else:
        fields["prompt"] = _prompt(body.get("prompt"))
    fields["stop"] = _stop(body.get("stop"))
    fields["stream"] = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object.", "stream_options")
    fields["include_usage"] = _flag(options, "include_usage", "stream_options.include_usage")
    fields["logprobs"] = _logprobs(body, chat)
    return GenerationRequest(**fields)


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """Chat: `logprobs` true, `top_logprobs` 0-20; completions: `logprobs` 0-5 alternatives."""
    if chat:
        top = body.get("top_logprobs")
        if not _flag(body, "logprobs"):
            if top is not None:
                raise RequestError(400, "top_logprobs needs logprobs: true.", "top_logprobs",
                                   "invalid_value")
            return None
        if top is None:
            return 0
        if type(top) is not int or not 0 <= top <= 20:
            raise RequestError(400, f"top_logprobs must be an int in [0, 20], got {top!r}.",
                               "top_logprobs", "invalid_value")
        return top
    value = body.get("logprobs")
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= 5:
        raise RequestError(400, f"logprobs must be an int in [0, 5], got {value!r}.", "logprobs",
                           "invalid_value")
    return value


# Fields that would change the answer, which this server does not implement: refused, not ignored.
UNSUPPORTED = {
    "tools": "tool calling", "tool_choice": "tool calling", "functions": "function calling",
    "function_call": "function calling", "best_of": "best_of",
    "echo": "echo", "audio": "audio output",
    "modalities": "output modalities", "prediction": "predicted outputs",
    # mlx-lm's server fields this one does not take
    "adapters": "adapters per request: start the server with --adapter-path",
    "draft_model": "a draft model per request: start the server with --draft-model",  # (but
    # mlx-lm's own name for the served one is taken: DEFAULT_DRAFT_ALIAS)
}
MAX_NUM_DRAFT_TOKENS = 64  # a request's k: more would only inflate the caches' rewind reserve
MAX_CONTEXT_SIZE = 1 << 20  # a penalty's window, in tokens (mlx-lm's fields; default 20)
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's, for presence_penalty and frequency_penalty
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's, per logit_bias entry


def _refuse_unsupported(body: dict) -> None:
    for field, what in UNSUPPORTED.items():
        value = body.get(field)
        if value is None or value is False or value == [] or (
                field == "draft_model" and value == DEFAULT_DRAFT_ALIAS):
            continue
        raise RequestError(400, f"{field} is not supported by this server ({what}); leave it "
                                "out.", field, "unsupported_parameter")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(400, "response_format is not supported by this server beyond "
                                "{\"type\": \"text\"} (no JSON mode or schemas); leave it out.",
                           "response_format", "unsupported_parameter")


# apply_chat_template's own arguments (the messages, the generation prompt, the template,
# tokenizing), and the template variables whose features this server refuses (tools: tool
# calling; documents): not template variables a request or --chat-template-args may set
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "add_generation_prompt", "tokenize",
                            "return_dict", "return_tensors", "chat_template",
                            "continue_final_message", "tokenizer_kwargs", "padding",
                            "truncation", "max_length", "return_assistant_tokens_mask",
                            "tools", "documents")


def template_kwargs(value, field: str) -> Dict[str, Any]:
    """A chat template's keyword arguments: a JSON object, none of the reserved names."""
    if not isinstance(value, dict):
        raise RequestError(400, f"{field} must be an object of keyword arguments for the chat "
                                "template, e.g. {\"enable_thinking\": false}.", field,
                           "invalid_value")
    reserved = next((key for key in value if key in RESERVED_TEMPLATE_KWARGS), None)
    if reserved is not None:
        raise RequestError(400, f"{field} may not set {reserved!r}: it is not a template "
                                "variable that can be passed on here.", field, "invalid_value")
    return dict(value)


def _suffix(value) -> bool:
    """`suffix` here is true or false (suffix drafting); OpenAI's text suffix is refused."""
    if isinstance(value, bool):
        return value
    raise RequestError(400, "suffix is true or false on this server (suffix drafting); a text "
                            "suffix (insertion) is not supported, leave it out.", "suffix",
                       "unsupported_parameter")


def _penalties(body: dict) -> Dict[str, Any]:
    """logit_bias and the penalties, checked: the worker makes mlx-lm's logits processors."""
    out: Dict[str, Any] = {}
    for field in ("presence_penalty", "frequency_penalty"):
        value = body.get(field)
        if value is not None:
            if not _is_number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise RequestError(400, f"{field} must be a number in [-2, 2], got {value!r}.",
                                   field, "invalid_value")
            out[field] = float(value)
    for field in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = body.get(field)
        if value is not None:
            if type(value) is not int or not 0 <= value <= MAX_CONTEXT_SIZE:
                raise RequestError(400, f"{field} must be an int in [0, {MAX_CONTEXT_SIZE}] (0: "
                                        f"the whole context, as mlx-lm's), got {value!r}.",
                                   field, "invalid_value")
            out[field] = value
    value = body.get("repetition_penalty")
    if value is not None:
        if not _is_number(value) or value <= 0:
            raise RequestError(400, f"repetition_penalty must be a number > 0, got {value!r}.",
                               "repetition_penalty", "invalid_value")
        out["repetition_penalty"] = float(value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RequestError(400, "logit_bias must be an object mapping token ids to numbers "
                                    "in [-100, 100].", "logit_bias", "invalid_value")
        pairs = []
        for key, number in bias.items():
            if not _is_token_id(key) or not _is_number(number) or \
                    not BIAS_RANGE[0] <= number <= BIAS_RANGE[1]:
                raise RequestError(400, f"logit_bias must map token ids (ASCII digits, e.g. "
                                        f"\"42\") to numbers in [-100, 100]; {key!r}: "
                                        f"{number!r} is not.", "logit_bias", "invalid_value")
            pairs.append((int(key), float(number)))
        out["logit_bias"] = tuple(pairs)
    return out


def _is_token_id(key: str) -> bool:
    """A token id as JSON keys write it: ASCII digits only ("²" and "٣" are digits to
    str.isdigit, and the first is no int)."""
    return key.isascii() and key.isdigit()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(argument: str, value, field: str) -> None:
    try:
        check_arguments(**{argument: value})
    except ValueError as exc:  # "temp must be ..." -> "temperature must be ..."
        message = str(exc)
        if message.startswith(argument):
            message = field + message[len(argument):]
        raise RequestError(400, message, field, "invalid_value") from None


def _check_model(model, model_id: str) -> None:
    if model is None or model in (model_id, DEFAULT_MODEL_ALIAS):
        return
    raise RequestError(404, f"The model {model!r} does not exist here: this server serves "
                            f"{model_id!r} (also called {DEFAULT_MODEL_ALIAS!r}).",
                       "model", "model_not_found")


def _max_tokens(body: dict, defaults: Settings) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if value is not None:
            _check("max_tokens", value, field)
            if value < 1:  # the API's -1 (no limit) is not for a server
                raise RequestError(400, f"{field} must be an int >= 1, got {value}.", field,
                                   "invalid_value")
            return value
    return defaults.max_tokens


def _flag(body: dict, field: str, name: Optional[str] = None) -> bool:
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(400, f"{name or field} must be true or false, got {value!r}.",
                           name or field, "invalid_type")
    return value


def _messages(messages) -> Tuple[Dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects.",
                           "messages", "invalid_value")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string role.",
                               f"messages[{i}]", "invalid_value")
        checked.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return tuple(checked)


def _content(content, i: int) -> str:
    """A message's text: a string, null (an assistant turn with tool calls), or text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts "
                            "({\"type\": \"text\", \"text\": ...}); this server reads text only.",
                       f"messages[{i}].content", "invalid_value")


def _prompt(prompt) -> Union[str, Tuple[int, ...]]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise RequestError(400, "Send one prompt per request (a batch of prompts is not "
                                "supported).", "prompt", "invalid_value")
    raise RequestError(400, "prompt must be a non-empty string or a non-empty list of token ids.",
                       "prompt", "invalid_value")


def _stop(stop) -> Tuple[str, ...]:
    if stop is None:
        return ()
    stops: List[Any] = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(400, "stop must be a non-empty string or a list of them.", "stop",
                           "invalid_value")
    return tuple(stops)
