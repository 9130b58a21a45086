"""`serve --allowed-origins` (mlx-lm's option): web pages of those origins may call the server
from their scripts (CORS preflight answered, the origin echoed on answers); a request from any
other page is refused (403) before any work, even one a browser sends with no preflight (a
text/plain POST), and with no --allowed-origins (the default here; mlx-lm's is any origin) no
page may. Clients that are not web pages send no Origin and are served as before.
"""

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import json  # noqa: E402

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
        elsewhere = httpx.post(url + "/v1/completions", timeout=60,  # (a "simple" request)
                               content=json.dumps(BODY).encode(),
                               headers={"Origin": "http://evil.test", "Authorization": "Bearer k",
                                        "Content-Type": "text/plain"})
        no_page = httpx.post(url + "/v1/completions", json=BODY, timeout=60,
                             headers={"Authorization": "Bearer k"})
        admitted = worker.admitted
    finally:
        server.should_exit = True
        thread.join(30)
    assert no_page.status_code == 200 and admitted == 0
    return preflight, post, elsewhere


def test_an_allowed_origin_may_call_it_and_others_may_not():
    preflight, post, elsewhere = answers([PAGE])
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert post.status_code == 200 and post.headers["access-control-allow-origin"] == PAGE
    assert elsewhere.status_code == 403 and "access-control-allow-origin" not in elsewhere.headers
    assert "--allowed-origins" in elsewhere.json()["error"]["message"]


def test_by_default_no_page_may():
    preflight, post, elsewhere = answers([])
    assert "access-control-allow-origin" not in preflight.headers
    assert preflight.status_code == 405
    assert post.status_code == 403 and elsewhere.status_code == 403
    assert "access-control-allow-origin" not in post.headers
