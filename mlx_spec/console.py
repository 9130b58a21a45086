"""The installed `mlx-spec` script: the command line, with Ctrl-C as one line and exit status 130.

It imports nothing but the standard library before it takes over SIGINT, so
an interrupt at any moment after the interpreter started (importing click,
importing MLX, loading a model, generating) prints "Interrupted." instead
of a traceback. A second Ctrl-C while unwinding ends the process at once.
"""

import signal
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Interrupted(BaseException):
    """Raised by the SIGINT handler; a BaseException, so no `except Exception` swallows it
    and click does not turn it into its own "Aborted!"."""


def _on_sigint(signum, frame):
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once
    raise Interrupted


def main():
    try:
        signal.signal(signal.SIGINT, _on_sigint)
        from .cli import main as cli

        cli()
    except Interrupted:
        # Start on a fresh line after the terminal's "^C" echo or half a streamed line.
        print("\nInterrupted." if sys.stderr.isatty() else "Interrupted.", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
