"""EAGLE-3 heads: one decoder layer that reads three tapped target layers (fused by `fc`) and
drafts autoregressively over a reduced vocabulary (`d2t`), as published by SafeAILab/EAGLE,
the speculators project and SpecForge.

`load_eagle3(path)` reads a head in any of the three layouts; `check_fits` refuses one made for
another target; the taps come from the verify pass (mlx_spec.dflash.taps). The drafter side is
`mlx_spec.drafters.eagle3.Eagle3Drafter`.
"""

from .config import Eagle3Config, is_eagle_config, parse_config
from .loading import check_fits, eagle3_directory, is_eagle3_head, load_eagle3
from .model import Eagle3Head

__all__ = ["Eagle3Config", "Eagle3Head", "check_fits", "eagle3_directory", "is_eagle_config",
           "is_eagle3_head", "load_eagle3", "parse_config"]
