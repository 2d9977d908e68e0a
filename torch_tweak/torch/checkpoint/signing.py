"""Signed checkpoints: a team trusts its own checkpoints (native code included) without trusting strangers'.

The sums file beside a checkpoint detects corruption, but whoever sent the checkpoint can rewrite it. A
signature cannot be forged without the key: ``tt.save(..., signing_key=key)`` stores ``signature.json`` in
the archive, a signature over the SHA-256 of the manifest (which lists the size and SHA-256 of every other
member, so it commits to the whole checkpoint), and ``tt.load(..., verify_key=key)`` refuses a checkpoint
whose signature is missing or does not verify. Two kinds of key:

* ``bytes`` (at least 16): a shared secret, HMAC-SHA256 (Python's ``hmac``).
* Ed25519 keys from the ``cryptography`` package: sign with an ``Ed25519PrivateKey``, verify with its
  ``Ed25519PublicKey`` (``pip install torch-tweak[signing]``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from torch_tweak.errors import CheckpointError, ConfigError

SIGNATURE_NAME = "signature.json"
SIGNATURE_FORMAT = "torch_tweak.signature"
_DOMAIN = b"torch_tweak.checkpoint.manifest.v1\n"
_MIN_SECRET_BYTES = 16


def _message(manifest: bytes) -> bytes:
    return _DOMAIN + hashlib.sha256(manifest).hexdigest().encode("ascii")


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise ConfigError("Ed25519 keys need the 'cryptography' package, which is not installed. Install it with: "
                          "pip install torch-tweak[signing] (or use a bytes secret for HMAC-SHA256).") from exc
    return ed25519


def _secret(key: bytes, what: str) -> bytes:
    if len(key) < _MIN_SECRET_BYTES:
        raise ConfigError(f"{what} is a {len(key)}-byte secret; HMAC keys need at least {_MIN_SECRET_BYTES} random "
                          "bytes (e.g. secrets.token_bytes(32)).")
    return bytes(key)


def sign(manifest: bytes, key: Any) -> bytes:
    """The ``signature.json`` member for ``manifest`` signed with ``key`` (bytes or an Ed25519 private key)."""
    if isinstance(key, (bytes, bytearray)):
        algorithm = "hmac-sha256"
        signature = hmac.new(_secret(key, "signing_key"), _message(manifest), hashlib.sha256).digest()
    else:
        ed25519 = _ed25519()
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"signing_key must be bytes (HMAC-SHA256) or a cryptography Ed25519PrivateKey, got "
                              f"{type(key).__name__}.")
        algorithm = "ed25519"
        signature = key.sign(_message(manifest))
    document = {"format": SIGNATURE_FORMAT, "algorithm": algorithm, "signature": signature.hex()}
    return json.dumps(document, separators=(",", ":")).encode("ascii")


def _parse(data: bytes | None, where: str) -> tuple[str, bytes]:
    if data is None:
        raise CheckpointError(f"{where} is not signed, but a verify_key was given; only checkpoints saved with "
                              "tt.save(..., signing_key=...) can be verified. Do not load it as trusted.")
    try:
        document = json.loads(data.decode("ascii"))
        ok = (isinstance(document, dict) and document.get("format") == SIGNATURE_FORMAT
              and document.get("algorithm") in ("hmac-sha256", "ed25519") and isinstance(document.get("signature"), str))
        signature = bytes.fromhex(document["signature"]) if ok else b""
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{where} has a malformed {SIGNATURE_NAME}; the checkpoint is corrupt.") from exc
    if not ok:
        raise CheckpointError(f"{where} has a malformed {SIGNATURE_NAME}; the checkpoint is corrupt.")
    return document["algorithm"], signature


def verify(manifest: bytes, signature_member: bytes | None, key: Any, where: str) -> str:
    """Check the signature of ``manifest`` with ``key``; return the algorithm, or raise CheckpointError."""
    algorithm, signature = _parse(signature_member, where)
    if isinstance(key, (bytes, bytearray)):
        if algorithm != "hmac-sha256":
            raise CheckpointError(f"{where} is signed with {algorithm}, but the verify_key is an HMAC secret.")
        expected = hmac.new(_secret(key, "verify_key"), _message(manifest), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, signature):
            raise CheckpointError(f"{where} has a signature that does not match the verify_key: it was signed with "
                                  "another key or modified after signing. Do not load it as trusted.")
        return algorithm
    ed25519 = _ed25519()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        key = key.public_key()
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ConfigError(f"verify_key must be bytes (HMAC-SHA256) or a cryptography Ed25519PublicKey, got "
                          f"{type(key).__name__}.")
    if algorithm != "ed25519":
        raise CheckpointError(f"{where} is signed with {algorithm}, but the verify_key is an Ed25519 key.")
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(signature, _message(manifest))
    except InvalidSignature as exc:
        raise CheckpointError(f"{where} has a signature that does not match the verify_key: it was signed with "
                              "another key or modified after signing. Do not load it as trusted.") from exc
    return algorithm
