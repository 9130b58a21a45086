"""The research beside the product, never installed: the standalone studies (studies/), the zoo
of target/draft pairs they measure (zoo.py) and their results (results/, listed in README.md).

Run from the repository root, where `bench` is importable: python -m bench.studies.<name>.
The studies import the installed package (`mlx_spec`); nothing in `mlx_spec` imports them.
"""
