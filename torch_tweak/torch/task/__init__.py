"""Reference-compatible import paths (``docs/migrating.md``); torch_tweak's profiling is in
:mod:`torch_tweak.torch.profiling`."""
