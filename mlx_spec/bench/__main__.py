"""`python -m mlx_spec.bench`: the same command as `mlx-spec bench`."""

from .cli import bench

if __name__ == "__main__":
    bench(prog_name="python -m mlx_spec.bench")
