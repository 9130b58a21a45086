"""`serve --allowed-origins` (mlx-lm's option): web pages of those origins may call the server
from their scripts (CORS preflight answered, the origin echoed on answers); other origins get
no CORS header, and with no --allowed-origins (the default here; mlx-lm's is any origin)
no page may.
"""

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402

from mlx_spec import load_default_pair  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.worker import GenerationWorker, SpeculationOptions  # noqa: E402

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
BODY = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


def answers(allowed):
    target, _, tokenizer = load_default_pair()
    worker = GenerationWorker(target, tokenizer, None,
                              SpeculationOptions(calibration=None, prefill_step_size=3))
    server, thread, url = serve_in_background(create_app(worker, "tiny", api_key="k",
                                                         allowed_origins=allowed))
    try:
        preflight = httpx.options(url + "/v1/completions", headers=PREFLIGHT, timeout=30)
        post = httpx.post(url + "/v1/completions", json=BODY, timeout=60,
                          headers={"Origin": PAGE, "Authorization": "Bearer k"})
        elsewhere = httpx.post(url + "/v1/completions", json=BODY, timeout=60,
                               headers={"Origin": "http://evil.test", "Authorization": "Bearer k"})
    finally:
        server.should_exit = True
        thread.join(30)
    return preflight, post, elsewhere


def test_an_allowed_origin_may_call_it_and_others_may_not():
    preflight, post, elsewhere = answers([PAGE])
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == PAGE
    assert elsewhere.status_code == 200 and "access-control-allow-origin" not in elsewhere.headers


def test_by_default_no_page_may():
    preflight, post, _ = answers([])
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 405
    assert post.status_code == 200 and "access-control-allow-origin" not in post.headers
