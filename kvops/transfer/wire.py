"""What travels between a prefill and a decode rank per request (``docs/transfer.md``): the metadata header, the
verdict, and the KV messages with their end marker and optional checksum. Pure helpers; the protocol's steps are in
:mod:`kvops.transfer.transport`.

Frames (the handshake's layout record, the header, the answer): one int64 tensor of :data:`FRAME_WORDS` words (4 KiB)
whatever they carry: ``[MAGIC, VERSION, n, v_1 .. v_n, 0, ...]``. Every frame is received into a buffer of that full
size filled with -1, so a peer sending a message of another size (half a header, random bytes, another version's
header) up to 4 KiB is *refused* (:func:`unframe` names why) instead of aborting the process inside gloo
(``EnforceNotMet ... op.preamble.length <= op.nbytes``, raised when a message is longer than the posted receive); a
shorter message leaves -1 in the tail, which must hold zeros. (A message longer than 4 KiB where a frame is expected,
or longer than the agreed KV message, still aborts gloo: it enforces that in its C++ transport.)

Header (both directions): the fields of :data:`FIELDS` after ``magic``/``version``. The prefill rank sends what it
will send, including the payload size; the decode rank answers with what it expects from that writer and a status
(``0``: agreed, KV follows; else a refusal from :data:`REFUSALS`). Both sides compare the two headers field by field,
so both raise naming the same fields and values.

KV message (one per grid segment and writer): the staging buffer ``[2, L, n, h, D]`` as bytes, zero-padded to a
multiple of 8 bytes, then an end marker of 4 int64 values ``[request_id, segment index, crc, 0]``. The decode rank
fills its marker slot with -1 before posting the receive, so a short message (which leaves the slot untouched) or a
message of another request or segment is detected; with ``checksum=True`` the CRC-32 of the padded payload
(:func:`checksum`) is checked too.
"""

from __future__ import annotations

import zlib

import torch

from .routing import _DTYPES

try:  # the same CRC-32 (zlib's polynomial), vectorized with PCLMULQDQ / AVX-512: ~5x zlib's (optional extra)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # stdlib zlib: the same values, slower (benchmarks/transfer_checksum.py)
    _crc32 = zlib.crc32

MAGIC = 0x4B564F5053  # "KVOPS"
VERSION = 2  # 1: headers of 13 words and a sum checksum
FRAME_WORDS = 512
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


def frame(values, device) -> torch.Tensor:
    """``values`` (ints) as a frame: ``[MAGIC, VERSION, len(values), *values]`` zero-padded to FRAME_WORDS."""
    out = torch.zeros(FRAME_WORDS, dtype=torch.int64, device=device)
    out[: len(values) + 3] = torch.tensor([MAGIC, VERSION, len(values), *map(int, values)], dtype=torch.int64)
    return out


def empty_frame(device) -> torch.Tensor:
    """A receive buffer for a frame: FRAME_WORDS words of -1 (a short message leaves some of them)."""
    return torch.full((FRAME_WORDS,), -1, dtype=torch.int64, device=device)


def unframe(buf: torch.Tensor, count: int) -> tuple[list[int] | None, str | None]:
    """The ``count`` values of a received frame, or ``(None, why it is not a kvops v2 frame of count values)``."""
    words = buf.tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        return None, (f"not a kvops v{VERSION} transfer message (magic {words[0] & (2**64 - 1):#x}, version "
                      f"{words[1]}; another kvops version or a foreign sender)")
    if words[2] != count:
        return None, f"a malformed kvops message (it declares {words[2]} values, expected {count})"
    if any(words[3 + count:]):
        return None, (f"a malformed kvops message (shorter or longer than the {FRAME_WORDS * 8}-byte frame, or "
                      f"garbage after its {count} values)")
    return words[3 : 3 + count], None


def encode(fields: dict, device) -> torch.Tensor:
    """``fields`` (every name of :data:`FIELDS` but ``magic``/``version``) as a frame."""
    return frame([fields[name] for name in FIELDS[2:]], device)


def decode(header: torch.Tensor) -> tuple[dict | None, str | None]:
    """A received header frame as ``{field: value}``, or ``(None, why not)``."""
    values, why = unframe(header, len(FIELDS) - 2)
    return (None, why) if values is None else (dict(zip(FIELDS, [MAGIC, VERSION, *values])), None)


def _show(name: str, value: int) -> str:
    if name == "dtype":
        return _DTYPES[value] if 0 <= value < len(_DTYPES) else f"<dtype code {value}>"
    if name == "checksum":
        return "on" if value else "off"
    return str(value)


def differences(prefill: dict, decode: dict) -> list[str]:
    """``"field: prefill a vs decode b"`` for every compared field that differs (both headers decoded)."""
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


def checksum(message: torch.Tensor, payload_bytes: int) -> int:
    """CRC-32 (zlib's polynomial, as ``zlib.crc32``) of the padded payload: any error burst of up to 32 bits, any
    odd number of flipped bits, swapped or moved words and rows are detected; other corruption passes with
    probability 2^-32. Computed on the host (a CUDA message is copied first); with the optional ``isal`` package
    (``pip install kvops[transfer]``) by ISA-L's folding CRC (PCLMULQDQ / AVX-512 VPCLMULQDQ), else by the
    standard library's zlib; the values are identical, so the two sides may differ in which one they have."""
    data = message[: padded(payload_bytes)]
    if data.device.type != "cpu":
        data = data.cpu()
    return _crc32(memoryview(data.numpy()))


def seal(message: torch.Tensor, payload_bytes: int, request_id: int, segment: int, with_checksum: bool) -> None:
    """Sender: zero the padding and write the end marker (and checksum) of a gathered message."""
    message[payload_bytes : padded(payload_bytes)].zero_()
    marker = message[padded(payload_bytes):].view(torch.int64)
    marker[0], marker[1] = request_id, segment
    marker[2], marker[3] = (checksum(message, payload_bytes) if with_checksum else 0), 0


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
    if with_checksum and [checksum(message, payload_bytes), 0] != marker[2:]:
        return "the payload checksum does not match (the KV bytes were corrupted in transit)"
    return None
