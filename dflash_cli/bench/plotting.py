"""matplotlib for the benches' PNGs: an optional extra (`pip install 'dflash-serve[bench]'`), not a
dependency of the server. Without it a bench still writes its JSON and markdown, and says in one log
line which PNG it skipped and how to get it."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)
EXTRA = "pip install 'dflash-serve[bench]'"


def pyplot(path: Path) -> ModuleType | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (logged, naming `path`) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("%s skipped: matplotlib is not installed (%s adds it)", path, EXTRA)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
