"""Optional integrations, activated only when their library is already imported by the user."""

from __future__ import annotations

import sys

from torch_tweak.torch.config import config

_DONE: set[str] = set()


def activate_integrations() -> None:
    """Register container types of libraries the process has imported (never imports them itself);
    ``tt.config.enable_hf_integrations = False`` skips Hugging Face."""
    if config.enable_hf_integrations and "transformers" in sys.modules and "transformers" not in _DONE:
        _DONE.add("transformers")
        from torch_tweak.torch.integrations import hugging_face

        hugging_face.register()
