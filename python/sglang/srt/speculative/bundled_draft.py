"""The EAGLE-3 draft shipped with the package for the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import os

BUNDLED_DRAFT_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "smollm2_eagle3"
)


def bundled_draft_path() -> str | None:
    """Directory of the bundled draft checkpoint, or None when this build has none."""
    ok = os.path.isfile(os.path.join(BUNDLED_DRAFT_DIR, "config.json"))
    return BUNDLED_DRAFT_DIR if ok else None
