"""Optional AES-GCM encryption of cached batches at rest (``cryptography`` is an extra).

The key comes from ``$CKPTCACHE_DATA_KEY`` (32 bytes as URL-safe base64 or 64 hex digits;
``python -c "import os,base64;print(base64.urlsafe_b64encode(os.urandom(32)).decode())"``
makes one). Every rank of a group needs the same key. Each batch is sealed with a fresh
random nonce and its cache key as associated data, so a file renamed to another step or
copied from another run fails authentication instead of being served.
"""

from __future__ import annotations

import base64
import binascii
import os

from ckptcache.errors import ConfigError, CorruptCheckpoint

__all__ = ["ENV_KEY", "NONCE_SIZE", "TAG_SIZE", "BatchCipher"]

ENV_KEY = "CKPTCACHE_DATA_KEY"
NONCE_SIZE = 12
TAG_SIZE = 16


def _decode_key(text: str) -> bytes:
    text = text.strip()
    try:
        key = bytes.fromhex(text) if len(text) == 64 else base64.urlsafe_b64decode(text)
    except (ValueError, binascii.Error) as e:
        raise ConfigError(f"${ENV_KEY} is neither hex nor URL-safe base64: {e}") from e
    if len(key) not in (16, 24, 32):
        raise ConfigError(f"${ENV_KEY} must decode to 16, 24 or 32 bytes, not {len(key)}")
    return key


class BatchCipher:
    """Seals and opens batch images with AES-GCM (authenticated: tampering is detected)."""

    def __init__(self, key: bytes):
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:
            raise ConfigError(
                "encrypt=True needs the 'cryptography' package: "
                "pip install 'ckptcache[data-encryption]'"
            ) from e
        self._aead = AESGCM(key)

    @classmethod
    def from_env(cls) -> BatchCipher:
        """The cipher for ``$CKPTCACHE_DATA_KEY``; :class:`ConfigError` if it is unset."""
        text = os.environ.get(ENV_KEY)
        if not text:
            raise ConfigError(
                f"encrypt=True needs a key in ${ENV_KEY} (32 random bytes, URL-safe base64), "
                "the same on every rank that shares the cache"
            )
        return cls(_decode_key(text))

    def seal(self, plaintext: memoryview, aad: bytes) -> bytes:
        """``nonce || ciphertext || tag`` of ``plaintext``."""
        nonce = os.urandom(NONCE_SIZE)
        return nonce + self._aead.encrypt(nonce, plaintext, aad)

    def open_into(self, sealed: memoryview, aad: bytes, out: memoryview) -> None:
        """Decrypt ``sealed`` into ``out`` (``len(sealed) - NONCE_SIZE - TAG_SIZE`` bytes)."""
        from cryptography.exceptions import InvalidTag

        nonce = bytes(sealed[:NONCE_SIZE])
        try:
            with sealed[NONCE_SIZE:] as body:
                if hasattr(self._aead, "decrypt_into"):  # cryptography >= 46: no extra copy
                    self._aead.decrypt_into(nonce, body, aad, out)
                else:
                    out[:] = self._aead.decrypt(nonce, body, aad)
        except InvalidTag as e:
            raise CorruptCheckpoint(
                "an encrypted cached batch failed authentication (wrong $CKPTCACHE_DATA_KEY, "
                "or the file was altered or moved); delete the cache directory",
                tier="data-cache",
            ) from e
