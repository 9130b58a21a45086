import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The tests' helpers (tiny, families, ...) and the repository's research beside the package
# (bench.studies, bench.zoo, training), importable however pytest is started and in every
# xdist worker.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

# Each test process (pytest-xdist runs two) keeps calibrations in its own directory: never the
# user's cache (nor a MLX_SPEC_CACHE_DIR of their shell), never another worker's.
os.environ["MLX_SPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlx-spec-tests-")
atexit.register(shutil.rmtree, os.environ["MLX_SPEC_CACHE_DIR"], ignore_errors=True)

from tiny import make_llama, perturbed, write_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def target_model():
    return make_llama(seed=0)


@pytest.fixture(scope="session")
def drafts(target_model):
    """Drafts of falling quality: identical, related-but-worse, unrelated."""
    return {
        "identical": target_model,
        "related": perturbed(target_model, noise=0.05, seed=1),
        "unrelated": make_llama(seed=7, hidden=32, layers=1),
    }


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Hugging Face-layout directories: a target, a draft, and a foreign-vocabulary draft."""
    root = tmp_path_factory.mktemp("models")
    return {
        "target": write_model_dir(root / "target", seed=0),
        "draft": write_model_dir(root / "draft", seed=3, hidden=32, layers=1),
        "foreign": write_model_dir(root / "foreign", vocab_size=280, seed=4, hidden=32, layers=1),
        "chat": write_model_dir(root / "chat", seed=0,
                                chat_template="<user>{{ messages[0]['content'] }}</user>\n"),
    }
