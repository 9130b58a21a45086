"""The installed `mlx-spec` script: the command line, with Ctrl-C as one line and exit status 130.

It imports nothing but the standard library before it takes over SIGINT, so
an interrupt at any moment after the interpreter started (importing click,
importing MLX, loading a model, generating) prints "Interrupted." instead
of a traceback. A second Ctrl-C while unwinding ends the process at once.

An interrupt is raised only where Python can unwind. One that lands while a
module is being imported ends the process at once instead (nothing needs
unwinding yet): raised there it could land in an extension's initialiser
(MLX's aborts the process) or in a callback Python cannot raise out of
(lost: the command went on waiting for stdin, Ctrl-C spent). The same goes
for one that lands later in a weakref callback or a `__del__`, which Python
hands to sys.unraisablehook.
"""

import os
import signal
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Interrupted(BaseException):
    """Raised by the SIGINT handler; a BaseException, so no `except Exception` swallows it
    and click does not turn it into its own "Aborted!"."""


def _say_interrupted() -> None:
    # Start on a fresh line after the terminal's "^C" echo or half a streamed line.
    print("\nInterrupted." if sys.stderr.isatty() else "Interrupted.", file=sys.stderr)


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe: there is nothing left to say on it
            pass
    _say_interrupted()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _on_sigint(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once
    if _importing(frame):
        _exit_now()
    raise Interrupted


def _unraisable(hook_args, previous=sys.unraisablehook):
    if isinstance(hook_args.exc_value, Interrupted):
        _exit_now()
    previous(hook_args)


def main():
    try:
        sys.unraisablehook = _unraisable
        signal.signal(signal.SIGINT, _on_sigint)
        from .cli import main as cli

        cli()
    except Interrupted:
        _say_interrupted()
        sys.exit(EXIT_INTERRUPTED)
