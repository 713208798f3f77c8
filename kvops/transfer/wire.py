"""What travels between a prefill and a decode rank per request (``docs/transfer.md``): the metadata header, the
verdict, and the KV messages with their end marker and optional checksum. Pure helpers; the protocol's steps are in
:mod:`kvops.transfer.transport`.

Header (both directions, one fixed-size int64 tensor, so a disagreement can never make a receive too small): the
fields of :data:`FIELDS`. The prefill rank sends what it will send; the decode rank answers with what it expects from
that writer and a status (``0``: agreed, KV follows; else a refusal from :data:`REFUSALS`). Both sides compare the
two headers field by field, so both raise naming the same fields and values.

KV message (one per grid segment and writer): the staging buffer ``[2, L, n, h, D]`` as bytes, zero-padded to a
multiple of 8 bytes, then an end marker of 4 int64 values ``[request_id, segment index, checksum_1, checksum_2]``.
The decode rank fills its marker slot with -1 before posting the receive, so a short message (which leaves the slot
untouched) or a message of another request or segment is detected; with ``checksum=True`` the two checksum words
(:func:`checksum`) are checked too.
"""

from __future__ import annotations

import torch

from .plan import _DTYPES

MAGIC = 0x4B564F5053  # "KVOPS"
VERSION = 1
FIELDS = ("magic", "version", "request_id", "num_tokens", "num_layers", "head_start", "num_heads", "head_dim",
          "dtype", "grid_tokens", "payload_bytes", "checksum", "status")
COMPARED = FIELDS[2:-1]  # magic/version are checked first; status is the decode rank's answer
STATUS_OK = 0
REFUSALS = {
    1: "its tokens could not be placed in the decode rank's cache",
    2: "its metadata differs",
    3: "another prefill rank writing to that decode rank failed",
}
MARKER_WORDS = 4
MARKER_BYTES = 8 * MARKER_WORDS


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(str(dtype).removeprefix("torch."))


def encode(fields: dict, device) -> torch.Tensor:
    """``fields`` (every name of :data:`FIELDS` but ``magic``/``version``) as the wire's int64 tensor."""
    values = {"magic": MAGIC, "version": VERSION, **fields}
    return torch.tensor([int(values[name]) for name in FIELDS], dtype=torch.int64, device=device)


def decode(header: torch.Tensor) -> dict:
    return dict(zip(FIELDS, header.tolist()))


def _show(name: str, value: int) -> str:
    if name == "dtype":
        return _DTYPES[value] if 0 <= value < len(_DTYPES) else f"<dtype code {value}>"
    if name == "checksum":
        return "on" if value else "off"
    return str(value)


def differences(prefill: dict, decode: dict) -> list[str]:
    """``"field: prefill a vs decode b"`` for every compared field that differs (a foreign header: one entry)."""
    for header in (prefill, decode):
        if header["magic"] != MAGIC or header["version"] != VERSION:
            return [f"not a kvops v{VERSION} transfer header (magic {header['magic']:#x}, version {header['version']})"]
    return [f"{name}: prefill {_show(name, prefill[name])} vs decode {_show(name, decode[name])}"
            for name in COMPARED if prefill[name] != decode[name]]


def padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def message_bytes(payload_bytes: int) -> int:
    """Bytes of one KV message carrying ``payload_bytes`` of staging buffer."""
    return padded(payload_bytes) + MARKER_BYTES


def split(message: torch.Tensor, payload_bytes: int, dtype: torch.dtype, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one message (uint8, ``message_bytes(payload_bytes)``, 8-byte aligned offset): the staging buffer
    ``shape`` of ``dtype``, and the end marker (int64 ``[4]``)."""
    staging = message[:payload_bytes].view(dtype).view(shape)
    marker = message[padded(payload_bytes):].view(torch.int64)
    return staging, marker


ROW_WORDS = 512  # checksum rows of 4 KiB


def checksum(message: torch.Tensor, payload_bytes: int) -> torch.Tensor:
    """int64 ``[2]``: the sum of the padded payload's int64 words, and the sum of its 4 KiB rows' sums weighted by
    the row's position (1, 2, ...), mod 2^64. Detects a corrupted word (any change of a word's value changes the
    first) and a moved or stale row; two passes of integer sums, no temporary of the payload's size."""
    words = message[: padded(payload_bytes)].view(torch.int64)
    full = words.numel() // ROW_WORDS * ROW_WORDS
    rows = torch.cat([words[:full].view(-1, ROW_WORDS).sum(1), words[full:].sum().view(1)])
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=words.device)
    return torch.stack([rows.sum(), (rows * weights).sum()])


def seal(message: torch.Tensor, payload_bytes: int, request_id: int, segment: int, with_checksum: bool) -> None:
    """Sender: zero the padding and write the end marker (and checksum) of a gathered message."""
    message[payload_bytes : padded(payload_bytes)].zero_()
    marker = message[padded(payload_bytes):].view(torch.int64)
    marker[0], marker[1] = request_id, segment
    if with_checksum:
        marker[2:] = checksum(message, payload_bytes)
    else:
        marker[2:] = 0


def arm(message: torch.Tensor, payload_bytes: int) -> None:
    """Receiver: fill the end-marker slot with -1 before posting the receive (a short message leaves it so)."""
    message[padded(payload_bytes):].fill_(0xFF)


def check(message: torch.Tensor, payload_bytes: int, request_id: int, segment: int, with_checksum: bool) -> str | None:
    """Receiver: ``None`` when a received message is whole and is this request's segment, else why not."""
    marker = message[padded(payload_bytes):].view(torch.int64).tolist()
    if marker[:2] == [-1, -1]:
        return "the message is shorter than agreed (its end marker did not arrive)"
    if marker[:2] != [request_id, segment]:
        return (f"the message belongs to request {marker[0]}, segment {marker[1]} (expected request {request_id}, "
                f"segment {segment}): it is shorter or longer than agreed, or out of order")
    if with_checksum and checksum(message, payload_bytes).tolist() != marker[2:]:
        return "the payload checksum does not match (the KV bytes were corrupted in transit)"
    return None
