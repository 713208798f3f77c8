"""The transfer's wire format without processes: the payload checksum is a CRC-32 that catches what the
old sums did not (two words swapped inside a 4 KiB row; the same bit flipped 0->1 and 1->0 in two words), frames
refuse messages of another size or version, and the endpoints refuse bad deadlines and request ids before anything
is sent. The same over gloo with real processes: tests/transfer/test_transfer_malformed.py."""

from __future__ import annotations

import math
import re
import zlib

import pytest
import torch

from kvops.cache import PagedKVCache
from kvops.transfer import KVReceiver, KVSender, TransferGroups, wire


def sealed(payload_bytes=3000, seed=0):
    g = torch.Generator().manual_seed(seed)
    msg = torch.randint(0, 256, (wire.message_bytes(payload_bytes),), dtype=torch.uint8, generator=g)
    wire.seal(msg, payload_bytes, 7, 1, True)
    assert wire.check(msg, payload_bytes, 7, 1, True) is None
    return msg


def words(msg, payload_bytes):
    return msg[: wire.padded(payload_bytes)].view(torch.int64)


@pytest.mark.parametrize("seed", range(4))
def test_checksum_catches_swapped_words_and_complementary_flips(seed):
    """Before: the checksum was the sum of the int64 words and the position-weighted sum of 4 KiB rows' sums, so a
    swap inside a row, or +2^b in one word and -2^b in another of the same row, left both sums unchanged."""
    n = 3000
    bad = "the payload checksum does not match"
    swapped = sealed(n, seed)
    w = words(swapped, n)
    w[[3, 40]] = w[[40, 3]].clone()
    assert wire.check(swapped, n, 7, 1, True).startswith(bad)
    flipped = sealed(n, seed)
    w = words(flipped, n)
    bit = next(b for b in range(63) if (int(w[5]) >> b & 1) != (int(w[9]) >> b & 1))
    w[5] ^= 1 << bit
    w[9] ^= 1 << bit  # one word gains 2^bit, the other loses it: the sums are equal
    assert wire.check(flipped, n, 7, 1, True).startswith(bad)
    single = sealed(n, seed)
    single[n - 1] ^= 0x80  # the payload's last byte (padding follows)
    assert wire.check(single, n, 7, 1, True).startswith(bad)


def test_checksum_is_zlib_crc32_of_the_padded_payload():
    """The same CRC-32 as the standard library's (so sides with and without the optional isal agree)."""
    msg = sealed(3001)
    assert wire.checksum(msg, 3001) == zlib.crc32(bytes(msg[: wire.padded(3001)].tolist()))
    assert words(msg, 3001).numel() * 8 == 3008


def test_frames_refuse_other_sizes_and_versions():
    """A received frame of another size, random bytes or a version-1 header is refused with the reason."""
    sent = wire.frame([1, 2, 3], "cpu")
    assert wire.unframe(sent, 3) == ([1, 2, 3], None)
    half = wire.empty_frame("cpu")
    half.view(torch.uint8)[: wire.FRAME_WORDS * 4] = sent.view(torch.uint8)[: wire.FRAME_WORDS * 4]
    assert "shorter or longer" in wire.unframe(half, 3)[1]
    noise = wire.empty_frame("cpu")
    noise.view(torch.uint8)[:1000] = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    assert "not a kvops v2 transfer message" in wire.unframe(noise, 3)[1]
    v1 = wire.empty_frame("cpu")
    v1[:13] = torch.tensor([wire.MAGIC, 1] + [0] * 11)
    assert wire.unframe(v1, 3)[1].startswith("not a kvops v2 transfer message (magic 0x4b564f5053, version 1")
    assert "declares 4 values, expected 3" in wire.unframe(wire.frame([1, 2, 3, 4], "cpu"), 3)[1]
    header = wire.encode(dict(request_id=5, num_tokens=12, num_layers=2, head_start=0, num_heads=2, head_dim=8,
                              dtype=wire.dtype_code(torch.float32), grid_tokens=8, payload_bytes=768, checksum=1,
                              status=0), "cpu")
    assert header.numel() == wire.FRAME_WORDS
    fields, why = wire.decode(header)
    assert why is None and fields["payload_bytes"] == 768 and fields["version"] == wire.VERSION


GROUPS = TransferGroups((0,), (1,))


def caches():
    return [torch.zeros(4, 4, 2, 8)], [torch.zeros(4, 4, 2, 8)]


@pytest.mark.parametrize("timeout", [-1, 0, math.inf, math.nan, True, "5", None])
def test_endpoints_refuse_bad_deadlines(timeout):
    """Before: ``timeout_s=-1`` was accepted (every wait then failed at once); ``nan``/``inf`` never time out."""
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds > 0 .*got " +
                       re.escape(repr(timeout))):
        KVSender(GROUPS, 0, *caches(), 2, timeout_s=timeout)
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        KVReceiver(GROUPS, 0, PagedKVCache(4, 4, 2, 8), 2, timeout_s=timeout)


@pytest.mark.parametrize("timeout", [-1, math.nan])
def test_connect_refuses_a_bad_deadline_before_posting(timeout):
    sender = KVSender(GROUPS, 0, *caches(), 2)
    with pytest.raises(ValueError, match="connect: timeout_s must be a finite number"):
        sender.connect(timeout_s=timeout)  # no process group: it would fail there if it posted anything


@pytest.mark.parametrize("request_id", [True, False, -1, 2**30, 1.0, "3"])
def test_receive_refuses_bad_request_ids_before_allocating(request_id):
    cache = PagedKVCache(4, 4, 2, 8)
    receiver = KVReceiver(GROUPS, 0, cache, 2)
    with pytest.raises(ValueError, match=r"request_id must be an int in \[0, 1073741823\]"):
        receiver.receive(request_id, 4)
    with pytest.raises(ValueError, match=r"request_id must be an int"):
        KVSender(GROUPS, 0, *caches(), 2).send(request_id, 4, torch.zeros(1, dtype=torch.int32))
    assert cache.seq_ids == [] and cache.num_free_blocks == 4
