"""Optional integrations, activated only when their library is already imported by the user."""

from __future__ import annotations

import sys

_DONE: set[str] = set()


def activate_integrations() -> None:
    """Register container types of libraries the process has imported (never imports them itself)."""
    if "transformers" in sys.modules and "transformers" not in _DONE:
        _DONE.add("transformers")
        from torch_tweak.torch.integrations import hugging_face

        hugging_face.register()
