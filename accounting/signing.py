"""Ed25519 signatures of release manifests (optional): the agency signs, auditors check.

The manifest names the signer's public key by its SHA-256 fingerprint; the signature over the
manifest's exact bytes is written beside it as `manifest.json.sig` (base64).
"""
from __future__ import annotations

import base64
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import SpecError

SIGNATURE_FILE = "manifest.json.sig"
MAX_KEY_BYTES = 64 << 10
"""Largest PEM key file read (an Ed25519 key is a few hundred bytes)."""


def _load_pem(data: bytes, path: object, option: str, private: bool):
    """An Ed25519 key from a PEM file's bytes (read by the caller through the storage layer, bounded); errors
    name the option, the path and what is allowed."""
    from .redact import shown

    kind = "unencrypted PEM private key" if private else "PEM public key"
    try:
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as error:
        raise SpecError(f"{option} = {shown(path)!r}: not a readable {kind} ({type(error).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey if private else Ed25519PublicKey):
        raise SpecError(f"{option} = {shown(path)!r}: must be an Ed25519 key (openssl genpkey -algorithm ed25519)")
    return key


def load_private_key(data: bytes, path: object = "--sign-key") -> Ed25519PrivateKey:
    return _load_pem(data, path, "--sign-key", private=True)


def load_public_key(data: bytes, path: object = "--public-key") -> Ed25519PublicKey:
    return _load_pem(data, path, "--public-key", private=False)


def fingerprint(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def sign(private_key: Ed25519PrivateKey, manifest: bytes) -> bytes:
    return base64.b64encode(private_key.sign(manifest)) + b"\n"


def well_formed(signature: bytes) -> bool:
    """Whether a signature file holds one base64 Ed25519 signature (64 bytes); says nothing of validity."""
    try:
        return len(base64.b64decode(signature.strip(), validate=True)) == 64
    except ValueError:
        return False


def check(public_key: Ed25519PublicKey, manifest: bytes, signature: bytes) -> bool:
    try:
        public_key.verify(base64.b64decode(signature.strip(), validate=True), manifest)
    except (InvalidSignature, ValueError):
        return False
    return True
