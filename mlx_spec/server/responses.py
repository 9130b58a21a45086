"""OpenAI's response shapes: whole answers, stream chunks, server-sent events, usage, errors.

Pure dictionaries (no HTTP library). Chat answers are `chat.completion`
objects and `chat.completion.chunk`s; completions are `text_completion`s,
streamed as the same object with a piece of text. Every final answer (and,
when streaming, the chunk that carries the finish reason) has an extra
`speculation` object built from `GenerationStats`; clients that do not know
it ignore it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Optional

from .requests import RequestError

if TYPE_CHECKING:  # the worker imports MLX; these shapes need only its field names
    from .worker import Finished

OWNER = "mlx-spec"


def error_body(error: RequestError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param,
                      "code": error.code}}


def sse(payload) -> str:
    """One server-sent event carrying `payload` as JSON (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


def models_body(model_id: str, created: int) -> dict:
    return {"object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": OWNER}]}


def usage(done: "Finished") -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def speculation(done: "Finished") -> Optional[dict]:
    """How speculation went for this answer (from `response.stats`)."""
    stats = done.stats
    if stats is None:
        return None
    return {"acceptance_rate": round(stats.acceptance_rate, 4),
            "tokens_per_round": round(stats.tokens_per_round, 4),
            "rounds": stats.rounds, "drafted": stats.drafted, "accepted": stats.accepted,
            "plain_steps": stats.plain_steps,
            "accepted_by_source": dict(stats.accepted_by_source),
            "calibrated": stats.calibrated, "rule": stats.rule,
            "generation_tps": round(stats.generation_tps, 2), **_kinds(stats)}


def _kinds(stats) -> dict:
    """What only some drafts report: a token tree's rounds, a draft of another tokenizer's
    rules and vocabulary overlap."""
    out = {}
    if stats.tree_rounds:
        out.update(tree_rounds=stats.tree_rounds, tree_nodes=stats.tree_nodes)
    if stats.vocab_overlap is not None:  # rule -> (rounds, drafted, accepted)
        out.update(vocab_overlap=round(stats.vocab_overlap, 4),
                   cross_rules={rule: list(counts) for rule, counts in stats.cross_rules.items()})
    return out


class Answer:
    """The shapes of one answer: its id, creation time and model, chat or text completion."""

    def __init__(self, chat: bool, model_id: str):
        self.chat, self.model_id = chat, model_id
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _object(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": None, "choices": choices}

    def logprobs(self, entries, offset: int = 0) -> Optional[dict]:
        """OpenAI's logprobs object for `entries` ((token, logprob, alternatives) per token):
        chat's `content` list, or a completion's parallel lists (`offset`: where the entries'
        text starts in the answer). None when logprobs were not asked for."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [{"token": token, "logprob": logprob,
                                 "bytes": list(token.encode()),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                  for t, v in alternatives]}
                                for token, logprob, alternatives in entries]}
        offsets = []
        for token, _, _ in entries:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": [token for token, _, _ in entries],
                "token_logprobs": [logprob for _, logprob, _ in entries],
                "top_logprobs": [dict(alternatives) for _, _, alternatives in entries],
                "text_offset": offsets}

    def whole(self, text: str, done: "Finished", entries=None) -> dict:
        """The non-streaming answer (`entries`: logprob entries, when asked for)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self.logprobs(entries), "finish_reason": done.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries),
                      "finish_reason": done.finish_reason}
        body = self._object("chat.completion" if self.chat else "text_completion", [choice])
        body.update(usage=usage(done), speculation=speculation(done))
        return body

    def chunk(self, text: Optional[str] = None, finish_reason: Optional[str] = None,
              first: bool = False, entries=None, offset: int = 0) -> dict:
        """A stream chunk: a piece of text, or (with `finish_reason`) the end of the choice."""
        logprobs = self.logprobs(entries, offset)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return self._object("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._object("text_completion", [choice])

    def last_chunk(self, done: "Finished") -> dict:
        body = self.chunk(finish_reason=done.finish_reason)
        body["speculation"] = speculation(done)
        return body

    def usage_chunk(self, done: "Finished") -> dict:
        """The chunk `stream_options.include_usage` asks for: no choices, the usage."""
        body = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        body.update(usage=usage(done), speculation=speculation(done))
        return body
