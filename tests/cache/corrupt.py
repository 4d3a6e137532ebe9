"""Fault injection into a host tier's storage, for tests of how damaged entries are handled."""

from cache.host_tier import EmbeddedHostKVTier


def corrupt_entry(tier: EmbeddedHostKVTier, key: str, byte_index: int = -1) -> None:
    """Flip every bit of one byte of the framed entry stored under `key` (KeyError if there is
    none), where the tier keeps it: the blob in its byte-budget LRU, replaced by one of the same
    length under its lock, as damage in host memory would leave it.  Byte 0 is the header's
    magic; -1 the payload's last byte."""
    with tier._lock:
        blob = bytearray(tier._data[key])
        blob[byte_index] ^= 0xFF
        tier._data[key] = bytes(blob)
