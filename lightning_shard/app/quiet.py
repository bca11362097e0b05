"""Third-party messages that are not the user's business, silenced by our commands (and their spawned ranks,
which start with fresh filters) but never on import of the library: a user's own script sees everything.

Kept: everything else, e.g. Lightning's sampler note before ``trainer.test`` on several ranks (it says how
the test metrics were computed).
"""

from __future__ import annotations

import logging
import warnings


def quiet() -> None:
    # Lightning 2.6 builds torch's LeafSpec, deprecated in torch 2.13: a FutureWarning per fit, validate and
    # test about Lightning's code, which nothing in a user's code or config can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Lightning advertises its cloud services on every run ("💡 Tip: ... litlogger", "... litmodels"); the
    # rank-zero logger is named after whichever of fabric and pytorch was imported last
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_a_tip)


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip")
