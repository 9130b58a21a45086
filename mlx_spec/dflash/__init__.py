"""DFlash block drafters: a few layers that read the target's hidden states and propose a
whole block of tokens in one pass (z-lab's published `DFlashDraftModel` layout, and
`DFlash2DraftModel`: the same plus dynamic causal convolutions and a candidate selector).

`load_dflash(path)` reads a published drafter; `check_fits` refuses one made
for another target; `tapped` captures the target's layer outputs from the
verify pass it runs anyway. The drafter protocol side is
`mlx_spec.drafters.dflash.DFlashDrafter` (`DFlash2Drafter` for DFlash2).
"""

from .config import DFlash2Parts, DFlashConfig, is_dflash_config, parse_config
from .dflash2 import DFlash2Model
from .loading import check_fits, dflash_directory, is_dflash_model, load_dflash
from .model import DFlashModel
from .taps import concatenated, decoder_layers, tap_capture, tapped

__all__ = ["DFlash2Model", "DFlash2Parts", "DFlashConfig", "DFlashModel", "check_fits",
           "concatenated", "decoder_layers", "dflash_directory", "is_dflash_config",
           "is_dflash_model", "load_dflash", "parse_config", "tap_capture", "tapped"]
