"""Device names: ``cpu``, ``xpu`` and ``xpu:N`` are accepted, everything else is refused."""

from __future__ import annotations

import re

import torch

from torch_tweak.errors import UnsupportedDeviceError

_XPU_RE = re.compile(r"^xpu(?::(\d{1,3}))?$")


def normalize_device_string(device: str | torch.device) -> str:
    """Return ``"cpu"`` or ``"xpu:N"`` for a supported device, else raise :class:`UnsupportedDeviceError`."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise UnsupportedDeviceError(f"A device must be a string or torch.device, got {type(device).__name__}.")
    text = device.strip().lower()
    if text == "cpu":
        return "cpu"
    match = _XPU_RE.match(text)
    if match:
        return f"xpu:{int(match.group(1) or 0)}"
    raise UnsupportedDeviceError(
        f"Unsupported device {device!r}: torch_tweak tunes on 'cpu', 'xpu' or 'xpu:N' (Intel GPUs). "
        "Pass device='cpu' to tune on the CPU."
    )


def get_device(device: str | torch.device) -> torch.device:
    """Normalize ``device`` and check that it exists on this machine."""
    name = normalize_device_string(device)
    if name.startswith("xpu"):
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise UnsupportedDeviceError(
                f"Device {name!r} was requested but torch.xpu.is_available() is False on this machine; "
                "install an XPU build of PyTorch with the Intel GPU driver, or use device='cpu'."
            )
        index = int(name.split(":")[1])
        if index >= xpu.device_count():
            raise UnsupportedDeviceError(f"Device {name!r} does not exist: this machine has {xpu.device_count()} XPU(s).")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on an asynchronous device (a no-op on the CPU)."""
    if device.type == "xpu":
        torch.xpu.synchronize(device)
