"""`mlx-spec serve`: an OpenAI-compatible HTTP server with exact speculative decoding.

The data flow of one request, one module per step:

    app.py          HTTP: routes, the API key, status codes; SSE or one JSON body
    requests.py     a JSON body -> a checked `GenerationRequest` (or a `RequestError`)
    prompts.py      messages or prompt -> token ids (chat template or a plain fallback)
    worker.py       the one generation thread: FIFO queue, admission limit, cancel flags
    cache_store.py  prompt caches kept between requests, found by token prefix (LRU, bytes)
    suffix_scope.py the suffix index a request drafts from: its own, its API key's, or all's
    stop_strings.py cuts the streamed text before a stop string
    responses.py    OpenAI's JSON and server-sent-event shapes, usage, `speculation`

Only app.py imports the HTTP stack (starlette, uvicorn: the `serve` extra);
the package core does not depend on it.
"""
