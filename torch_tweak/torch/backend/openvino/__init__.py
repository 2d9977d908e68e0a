"""OpenVINO backend. Importing this package does not import ``openvino``; building or loading a backend does."""

from torch_tweak.torch.backend.openvino.openvino_backend import OpenVINOBackend, OpenVINOBackendConfig

__all__ = ["OpenVINOBackend", "OpenVINOBackendConfig"]
