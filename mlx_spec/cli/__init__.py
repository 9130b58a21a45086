"""The `mlx-spec` command line: parses flags, calls the Python API, prints. No maths here.

One module per command (generate, check, tune, serve, bench), the option
groups they share in `options`, and the one model resolver in `models`.
Importing it imports no MLX (the commands import the API when they run), so
`--help` and `--version` answer at once. Every bad input is one line and a
non-zero exit; `mlx_spec.console.main`, the installed script, adds Ctrl-C
handling.
"""

from __future__ import annotations

import click

from .. import __version__
from .bench import bench
from .check import check
from .generate import generate
from .serve import serve
from .tune import tune


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="mlx-spec")
def main():
    """Exact speculative decoding on MLX: a draft proposes, the target verifies."""


for command in (generate, check, tune, serve, bench):
    main.add_command(command)
