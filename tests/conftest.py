import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_llama, perturbed  # noqa: E402


@pytest.fixture(scope="session")
def target_model():
    return make_llama(seed=0)


@pytest.fixture(scope="session")
def drafts(target_model):
    """Drafts of falling quality: identical, related-but-worse, unrelated."""
    return {
        "identical": target_model,
        "related": perturbed(target_model, noise=0.3, seed=1),
        "unrelated": make_llama(seed=7, hidden=32, layers=1),
    }
