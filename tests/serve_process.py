"""The real `mlx-spec serve` command in a subprocess, for the tests that run it end to end."""

import contextlib
import re
import subprocess
import sys


@contextlib.contextmanager
def serving(*args):
    """`mlx-spec serve --port 0 ARGS`: yields (process, its first stderr line, the base URL
    ending in /v1); killed on the way out if a test left it running."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec", "serve", "--port", "0",
                             *map(str, args)], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith("Serving "), line
        yield proc, line, re.search(r"(http://\S+/v1);", line).group(1)
    finally:
        if proc.poll() is None:
            proc.kill()


def stop(proc, sig, status):
    """Send `sig`; the server exits with `status` and no traceback."""
    proc.send_signal(sig)
    assert proc.wait(30) == status
    assert "Traceback" not in proc.stderr.read()
