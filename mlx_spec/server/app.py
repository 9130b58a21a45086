"""HTTP: routes, the API key and status codes; an answer as server-sent events or one JSON body.

    POST /v1/chat/completions   messages -> chat.completion (or chunks with "stream": true)
    POST /v1/completions        prompt -> text_completion (or chunks)
    GET  /v1/models             the one model served (also GET /v1/models/{id})
    GET  /health                {"status": "ok", ...}: queue, slots, prompt cache store, suffix

A request is parsed and checked (requests.py), turned into token ids
(prompts.py) and handed to the generation worker (worker.py) on the event
loop; the handler then waits for the worker's first event, so an error
before the answer starts is a proper status code. Every refusal is a 4xx (or
503) with OpenAI's body `{"error": {"message", "type", "param", "code"}}`.
A client that leaves (while queued, while a JSON answer is being made, or
mid-stream) cancels its job: the worker sees it before the next token.
The request's API key reaches the worker only as its suffix partition (a
digest, suffix_scope.py); at shutdown the suffix indexes are saved to their
file, if the server has one.

The HTTP stack is starlette (ASGI routes, `StreamingResponse` for SSE) on
uvicorn (signals: graceful shutdown on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
from dataclasses import dataclass
from functools import partial
from typing import Optional, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..loading import vocab_size
from .prompts import chat_prompt_ids, check_context, completion_prompt_ids, context_length
from .requests import GenerationRequest, RequestError, Settings, parse_request
from .responses import DONE, Answer, error_body, models_body, sse
from .worker import Busy, Failed, Finished, GenerationWorker, Job, TextDelta

@dataclass(frozen=True)
class Limits:
    """What one request may ask for; beyond it, a 4xx before any work (`serve` flags)."""

    max_body_bytes: int = 4 * 2**20  # 413 before the body is read
    max_tokens: int = 8192  # a request's max_tokens ceiling (--max-tokens is only the default)
    max_prompt_tokens: int = 32768


logger = logging.getLogger("mlx_spec.server")
GRACEFUL_SHUTDOWN_S = 3  # then uvicorn cancels the requests still open (their jobs with them)
WORKER_JOIN_S = 30
CLIENT_GONE = 499  # nginx's "client closed request"; nobody reads it
GONE = object()  # the event a handler gets when its client has left


class EventStream(StreamingResponse):
    """Server-sent events whose end (done, or the client gone) cancels the job at once."""

    def __init__(self, content, worker: GenerationWorker, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.job = worker, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.worker.cancel(self.job)  # a no-op once the job has finished


def error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


class Endpoints:
    """The route handlers for one served model (its worker, id, defaults and API key)."""

    def __init__(self, worker: GenerationWorker, model_id: str, defaults: Settings,
                 api_key: Optional[str], limits: Limits = Limits(),
                 allowed_origins: Sequence[str] = ()):
        self.worker, self.model_id, self.defaults, self.limits = worker, model_id, defaults, limits
        self.origins = frozenset(allowed_origins)
        self.vocab, self.context = vocab_size(worker.target_model), context_length(worker.target_model)
        self.created = int(time.time())
        self.expected = f"Bearer {api_key}".encode() if api_key is not None else None

    def authorize(self, request: Request) -> None:
        """401 without the API key; 403 for a web page's request from an origin not allowed
        (a browser sends some cross-origin POSTs with no preflight: refused before any work)."""
        origin = request.headers.get("origin")
        if origin is not None and origin not in self.origins and "*" not in self.origins:
            raise RequestError(403, f"Requests from web pages of {origin} are not allowed here; "
                                    "start the server with --allowed-origins to allow them.",
                               code="origin_not_allowed")
        if self.expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self.expected):
            raise RequestError(401, "Missing or wrong API key: send `Authorization: Bearer KEY` "
                                    "with the key the server was started with (--api-key).",
                               code="invalid_api_key")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generation(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generation(request, chat=False)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(models_body(self.model_id, self.created))

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        name = request.path_params["name"]
        if name != self.model_id:
            raise RequestError(404, f"The model {name!r} does not exist here: this server serves "
                                    f"{self.model_id!r}.", "model", "model_not_found")
        return JSONResponse(models_body(self.model_id, self.created)["data"][0])

    async def health(self, request: Request) -> Response:
        self.authorize(request)
        worker, store = self.worker, self.worker.store
        return JSONResponse({
            "status": "ok", "model": self.model_id,
            "requests": {"admitted": worker.admitted, "running": worker.running is not None,
                         "max_concurrency": worker.max_concurrency},
            "prompt_cache": None if store is None else
            {"entries": len(store), "bytes": store.nbytes, "max_bytes": store.max_bytes},
            "suffix": worker.suffix.summary()})

    def _prompt_ids(self, req: GenerationRequest):
        """The request's token ids and budget (tokenizing and the chat template: off the loop)."""
        tokenizer = self.worker.tokenizer
        if req.chat:
            ids, param = chat_prompt_ids(tokenizer, req.messages,
                                         dict(req.settings.chat_template_kwargs)), "messages"
        else:
            ids, param = completion_prompt_ids(tokenizer, req.prompt, self.vocab), "prompt"
        if len(ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"The prompt is {len(ids)} tokens; this server takes at "
                                    f"most {self.limits.max_prompt_tokens} (--max-prompt-tokens).",
                               param, "context_length_exceeded")
        return ids, check_context(ids, self.context, req.settings.max_tokens, param)

    def _check_limits(self, req: GenerationRequest) -> None:
        if req.settings.max_tokens > self.limits.max_tokens:
            raise RequestError(400, f"max_tokens must be at most {self.limits.max_tokens} on "
                                    f"this server (--max-tokens-limit), got "
                                    f"{req.settings.max_tokens}.", "max_tokens", "invalid_value")
        bad = next((t for t, _ in req.settings.logit_bias if t >= self.vocab), None)
        if bad is not None:
            raise RequestError(400, f"logit_bias names token id {bad}, outside the model's "
                                    f"vocabulary (0..{self.vocab - 1}).", "logit_bias",
                               "invalid_value")

    async def _generation(self, request: Request, chat: bool) -> Response:
        self.authorize(request)
        req = parse_request(await _json(request, self.limits.max_body_bytes), chat,
                            self.model_id, self.defaults)
        self._check_limits(req)
        ids, max_tokens = await asyncio.to_thread(self._prompt_ids, req)
        events: asyncio.Queue = asyncio.Queue()
        sink = partial(asyncio.get_running_loop().call_soon_threadsafe, events.put_nowait)
        worker = self.worker
        job = Job(req, ids, max_tokens, sink,  # the key itself goes no further than this line
                  worker.suffix.partition(request.headers.get("authorization")))
        try:
            worker.submit(job)
        except Busy as exc:
            raise RequestError(exc.status, str(exc), code="rate_limit_exceeded"
                               if exc.status == 429 else "server_shutting_down") from None
        answer = Answer(chat, self.model_id)
        try:
            async with _watching(request, worker, job, events):
                first = await events.get()
                if first is GONE:
                    return Response(status_code=CLIENT_GONE)
                if isinstance(first, Failed):
                    return error_response(RequestError(first.status, first.message))
                if not req.stream:
                    return await _collect(answer, first, events, req.logprobs is not None)
        except BaseException:
            worker.cancel(job)
            raise
        return EventStream(_stream(answer, first, events, req.include_usage,
                                   req.logprobs is not None), worker, job)


def create_app(worker: GenerationWorker, model_id: str, defaults: Settings = Settings(),
               api_key: Optional[str] = None, limits: Limits = Limits(),
               allowed_origins: Sequence[str] = ()) -> Starlette:
    """The ASGI app serving `worker`'s models as `model_id`; it starts and stops the worker.
    `allowed_origins`: web pages whose scripts may call it (CORS; "*": any page), none by
    default."""
    endpoints = Endpoints(worker, model_id, defaults, api_key, limits, allowed_origins)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close, WORKER_JOIN_S)
            await asyncio.to_thread(_save_suffix, worker)

    routes = [Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
              Route("/v1/completions", endpoints.completions, methods=["POST"]),
              Route("/v1/models", endpoints.models, methods=["GET"]),
              Route("/v1/models/{name:path}", endpoints.model, methods=["GET"]),
              Route("/health", endpoints.health, methods=["GET"])]
    handlers = {RequestError: _refused, HTTPException: _http_error,
                ClientDisconnect: _client_gone, Exception: _server_error}
    middleware = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                             allow_methods=["GET", "POST"], allow_headers=["*"])] \
        if allowed_origins else []
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                     middleware=middleware)


def _save_suffix(worker: GenerationWorker) -> None:
    """At shutdown: the suffix indexes to their file (--suffix-file), if any."""
    try:
        worker.suffix.save()
    except OSError as exc:
        logger.error("Could not save the suffix index to %s: %s.", worker.suffix.path,
                     exc.strerror or exc)


async def _json(request: Request, max_bytes: int):
    """The body as JSON, read only up to `max_bytes` (413 beyond, by its Content-Length before
    anything is read, or as soon as the stream passes it)."""
    too_big = RequestError(413, f"The request body is larger than this server takes "
                                f"({max_bytes} bytes, --max-body-bytes).", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise too_big
    try:
        return json.loads(bytes(body))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise RequestError(400, f"The request body is not valid JSON: {exc}.",
                           code="invalid_json") from None


@contextlib.asynccontextmanager
async def _watching(request: Request, worker: GenerationWorker, job: Job, events: asyncio.Queue):
    """Inside, a client that leaves cancels its job and wakes the handler with GONE.

    Only until the answer starts: a streamed answer's own disconnect listener
    (starlette's) takes over then, so that one task at a time reads `receive`.
    """
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        worker.cancel(job)
        events.put_nowait(GONE)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _collect(answer: Answer, event, events: asyncio.Queue, logprobs: bool) -> Response:
    parts, entries = [], []
    while isinstance(event, TextDelta):
        parts.append(event.text)
        entries += event.logprobs
        event = await events.get()
    if event is GONE:
        return Response(status_code=CLIENT_GONE)
    if isinstance(event, Failed):
        return error_response(RequestError(event.status, event.message))
    return JSONResponse(answer.whole("".join(parts), event, entries if logprobs else None))


async def _stream(answer: Answer, event, events: asyncio.Queue, include_usage: bool,
                  logprobs: bool):
    if answer.chat:
        yield sse(answer.chunk(first=True))
    offset = 0  # where the next chunk's text starts (a completion's text_offset)
    while True:
        if isinstance(event, TextDelta):
            yield sse(answer.chunk(event.text, entries=event.logprobs if logprobs else None,
                                   offset=offset))
            offset += len(event.text)
        elif isinstance(event, Finished):
            yield sse(answer.last_chunk(event))
            if include_usage:
                yield sse(answer.usage_chunk(event))
            break
        elif isinstance(event, Failed):  # after the answer started: an error event, then the end
            yield sse(error_body(RequestError(event.status, event.message)))
            break
        else:  # GONE: the client left as the answer started
            return
        event = await events.get()
    yield DONE


async def _refused(request: Request, exc: RequestError) -> Response:
    return error_response(exc)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"No route {request.url.path}; this server answers /v1/chat/completions, "
                    "/v1/completions, /v1/models and /health.",
               405: f"{request.method} is not allowed on {request.url.path}."}
    return error_response(RequestError(exc.status_code, message.get(exc.status_code, exc.detail)))


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """A client that left before its body was complete: no error, nobody reads the answer."""
    return Response(status_code=CLIENT_GONE)


async def _server_error(request: Request, exc: Exception) -> Response:
    """No exception text to the client (it may hold paths or prompt text): to the log."""
    logger.error("internal error on %s", request.url.path, exc_info=exc)
    return error_response(RequestError(500, "Internal server error; the server log has the "
                                            "details."))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); OSError if it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def make_server(app: Starlette, log_level: str = "warning"):
    """A uvicorn server for `app`; `.run(sockets=[bind(...)])` serves until a signal."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("info", "debug"),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    return uvicorn.Server(config)


def serve_in_background(app: Starlette, timeout: float = 60.0):
    """(server, thread, url): `app` served on a free loopback port from a daemon thread, for
    tests and studies that talk to a server in their own process; RuntimeError if it does not
    start within `timeout` seconds. `server.should_exit = True` then `thread.join()` stop it."""
    import threading

    sock = bind("127.0.0.1", 0)
    server = make_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError("the server did not start")
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"
