"""The release key and the keyed, seekable keystreams derived from it.

Randomness of a release comes only from here: a 256-bit secret key drawn from the OS,
expanded with HMAC-SHA256 into one subkey per purpose (a table's noise, bounding), and
AES-256 in counter mode. Cell c of a table owns a fixed slice of the keystream
(`WORDS_PER_CELL` 64-bit words per "round"); a cell whose sampler needs more words reads
round 1, 2, ... of its own slice. So the noise of (key, table, cell) is a pure function
of those three, whatever batching, worker or engine draws it, and a retried task redraws
exactly the same values. Engines draw with the key *bound* to its release (`ReleaseKey.bind`:
dataset, release, spec hash, input fingerprint), never with the key file's key directly.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_BYTES = 32
WORDS_PER_CELL = 2
_BLOCKS_PER_CELL = WORDS_PER_CELL * 8 // 16


class ReleaseKey:
    """A release's 256-bit secret. Never written into a release directory or a manifest."""

    def __init__(self, secret: bytes):
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a release key has {KEY_BYTES} bytes, got {len(secret)}")
        self._secret = bytes(secret)

    @classmethod
    def generate(cls) -> "ReleaseKey":
        return cls(os.urandom(KEY_BYTES))

    @classmethod
    def from_hex(cls, data: bytes) -> "ReleaseKey":
        """A key from a key file's bytes (hex, as `save` writes it)."""
        try:
            secret = bytes.fromhex(data.decode("ascii").strip())
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"expected {KEY_BYTES * 2} hex digits") from None
        return cls(secret)

    @classmethod
    def load(cls, path: Path) -> "ReleaseKey":
        return cls.from_hex(Path(path).read_bytes())

    def exported(self) -> bytes:
        """The key as a key file holds it (hex): only to hand one run's bound key to its own workers through
        private storage (`transforms.beam.KeyFromFile`), removed after the run."""
        return (self._secret.hex() + "\n").encode("ascii")

    def save(self, path: Path) -> None:
        """Write the key as hex to a new file readable by its owner only (never overwrites)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self._secret.hex() + "\n")

    def derive(self, purpose: str) -> bytes:
        """A 256-bit subkey for one purpose; subkeys of distinct purposes are independent."""
        return hmac.new(self._secret, purpose.encode("utf-8"), hashlib.sha256).digest()

    def bind(self, *context: str) -> "ReleaseKey":
        """The key of one release: a subkey bound to its public context (dataset id, release id, spec hash)
        and the input's keyed fingerprint. Privacy: every noise value, bounding choice and shard salt is
        derived from the bound key, so one key file reused for another release, another spec or another
        input draws independent noise, never the same noise over different data (which would publish the
        exact difference of the true counts)."""
        encoded = b"".join(len(part.encode()).to_bytes(4, "big") + part.encode() for part in context)
        return ReleaseKey(hmac.new(self._secret, b"dprelease/release-binding\0" + encoded, hashlib.sha256).digest())

    def fingerprint(self, chunks) -> str:
        """A keyed hash (HMAC-SHA256 under a subkey of this key) of a sequence of byte chunks: tells two
        inputs apart without revealing anything about them to someone who lacks the key. Internal only:
        stored in the ledger, never published."""
        mac = hmac.new(self.derive("dprelease/input-fingerprint"), digestmod=hashlib.sha256)
        for chunk in chunks:
            mac.update(chunk)
        return mac.hexdigest()

    def key_id(self) -> str:
        """A public identifier of the key (a one-way hash): tells two releases' keys apart."""
        return self.derive("dprelease/key-id").hex()[:16]


class CellStream:
    """The keystream of one table: `block(round, start, stop)` gives each cell its words."""

    def __init__(self, subkey: bytes):
        self._algorithm = algorithms.AES(subkey)

    @classmethod
    def for_table(cls, key: ReleaseKey, table: str) -> "CellStream":
        return cls(key.derive(f"dprelease/noise/{table}"))

    def block(self, round_index: int, start: int, stop: int) -> np.ndarray:
        """Words of cells [start, stop) in `round_index`, shape (stop - start, WORDS_PER_CELL), read-only."""
        nonce = round_index.to_bytes(8, "big") + (start * _BLOCKS_PER_CELL).to_bytes(8, "big")
        encryptor = Cipher(self._algorithm, modes.CTR(nonce)).encryptor()
        count = stop - start
        size = count * WORDS_PER_CELL * 8
        out = np.empty(size + 15, dtype=np.uint8)
        written = encryptor.update_into(_zeros(size), out)
        assert written == size
        return out[:size].view("<u8").reshape(count, WORDS_PER_CELL)

    def lane_rounds(self, start: int, stop: int, rounds: int) -> np.ndarray:
        """Rounds 0..rounds-1 of cells [start, stop), concatenated per cell: shape (stop - start,
        rounds * WORDS_PER_CELL), the same words `block` gives. One AES call over the CTR counter blocks
        (round in the high 64 bits, cell block in the low 64 bits, as `block`'s nonce and counter), so a
        lane that needs many rounds costs one cipher call, not one per round."""
        cells = np.arange(start, stop, dtype=np.uint64)
        counters = np.empty((stop - start, rounds, _BLOCKS_PER_CELL, 2), dtype=">u8")
        counters[..., 0] = np.arange(rounds, dtype=np.uint64)[None, :, None]
        counters[..., 1] = (cells[:, None, None] * np.uint64(_BLOCKS_PER_CELL)
                            + np.arange(_BLOCKS_PER_CELL, dtype=np.uint64)[None, None, :])
        encryptor = Cipher(self._algorithm, modes.ECB()).encryptor()
        stream = encryptor.update(counters.tobytes()) + encryptor.finalize()
        return np.frombuffer(stream, dtype="<u8").reshape(stop - start, rounds * WORDS_PER_CELL)


_ZEROS = memoryview(bytes(1 << 22))


def _zeros(size: int) -> memoryview | bytes:
    return _ZEROS[:size] if size <= len(_ZEROS) else bytes(size)


def prf_blocks(subkey: bytes, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """AES-256 as a pseudorandom permutation on 128-bit blocks (first || second, uint64 each):
    one encrypted block per input row, shape (n, 2) uint64."""
    data = np.column_stack((first, second)).astype("<u8").tobytes()
    encryptor = Cipher(algorithms.AES(subkey), modes.ECB()).encryptor()
    return np.frombuffer(encryptor.update(data), dtype="<u8").reshape(-1, 2)
