"""Where proposals come from: a draft model (of the target's vocabulary or, across a
`VocabBridge`, of another: cross_tokenizer.py), n-gram lookup in the text so far, suffix drafting
from everything seen before (suffix_index.py holds it), the target's MTP layer, a DFlash block
drafter (DFlash2: the same block pass, its drafts picked by a candidate selector).

A drafter has these methods, called by the loop:

    propose(history, k) -> Proposal | None   lazy tokens (and q) for this round
    commit(num_accepted)                     rewind its state after verification
    can_propose(history) -> bool             would it propose (cheap: decides when plain
                                             decoding stops to let it try)
    attach(history)                          optional: the call's history list, before the
                                             first round (a drafter that reads it as it grows)
    follow(tokens, hidden)                   only with `follows_target = True` (MTP, DFlash): after
                                             every round and prefill chunk, the target's hidden
                                             states at the kept positions (T, H) and the token
                                             after each

`history` is every token known so far (prompt + generated, host ints); its
last token is the one the target has not processed yet. None means "no
proposal this round" so the next drafter in line is asked.
"""

from __future__ import annotations

from .cross_tokenizer import CrossTokenizerDrafter
from .dflash import DFlashDrafter
from .dflash2 import DFlash2Drafter
from .draft_model import DraftModelDrafter
from .mtp import MTPDrafter
from .prompt_lookup import PromptLookupDrafter
from .protocol import Proposal
from .suffix import SuffixDrafter, default_suffix_index
from .suffix_index import SuffixIndex

__all__ = ["Proposal", "CrossTokenizerDrafter", "DFlash2Drafter", "DFlashDrafter", "DraftModelDrafter", "MTPDrafter", "PromptLookupDrafter",
           "SuffixDrafter", "SuffixIndex", "default_suffix_index"]
