"""The GGUF header reader (no torch, no gguf package): key/value metadata and the tensor table of a `.gguf` file.

gguf.GGUFReader materialises every array (a 262k-entry tokenizer vocabulary: seconds in Python), which `check`
cannot afford, so the header is walked directly over a memory map, every length checked against the file size;
long arrays are skipped and only their length kept. check/spec.py turns the metadata into a TargetSpec.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from draftport.errors import bad_input

# GGUF metadata. gguf.GGUFReader materialises every array (262k tokenizer strings: seconds),
# so the key/value header is walked directly, with every length checked against the file size.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
class _GGUFCursor:
    def __init__(self, buf, path: str, endian: str):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)
        self.e = endian

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.end:
            raise bad_input(self.path, f"GGUF header runs past the end of the file at byte {self.pos}")
        v = struct.unpack_from(self.e + fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self, keep: bool = True) -> str | None:
        n = self.take("Q")
        if n > self.end - self.pos:
            raise bad_input(self.path, f"GGUF string of {n} bytes at byte {self.pos} runs past the end of the file")
        start, self.pos = self.pos, self.pos + n
        if not keep:
            return None
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise bad_input(self.path, f"GGUF string at byte {start} is not UTF-8")

    def value(self, vtype: int, keep_arrays: bool):
        if vtype in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _GGUF_SCALARS:
                size = struct.calcsize(_GGUF_SCALARS[etype]) * count
                if size > self.end - self.pos:
                    raise bad_input(self.path, f"GGUF array of {count} items runs past the end of the file")
                keep = keep_arrays and count <= 4096
                fmt = f"{self.e}{count}{_GGUF_SCALARS[etype]}"
                vals = list(struct.unpack_from(fmt, self.buf, self.pos)) if keep else SkippedArray(count)
                self.pos += size
                return vals
            if etype == _GGUF_STRING:
                if count > (self.end - self.pos) // 8:
                    raise bad_input(self.path, f"GGUF array of {count} strings runs past the end of the file")
                keep = keep_arrays and count <= 4096
                items = [self.string(keep) for _ in range(count)]
                return items if keep else SkippedArray(count)
            raise bad_input(self.path, f"GGUF array of unsupported element type {etype}")
        raise bad_input(self.path, f"GGUF value of unknown type {vtype} at byte {self.pos}")


@dataclass(frozen=True)
class SkippedArray:
    count: int  # a long array we skipped over: only its length is kept


def read_gguf_header(path: str | os.PathLike, keep_arrays: bool = True) -> tuple[dict, list, int]:
    """(metadata {key: value}, tensors [(name, shape as written, ggml type)], bytes parsed).

    Arrays longer than 4096 items come back as `SkippedArray(count)`; numbers as Python scalars.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise bad_input(path, "no such file")
    with open(path, "rb") as f:
        if os.path.getsize(path) < 24:
            raise bad_input(path, "too short to be a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != b"GGUF":
                raise bad_input(path, "not a GGUF file (bad magic)")
            version = struct.unpack_from("<I", mm, 4)[0]
            endian = "<" if version in (2, 3) else ">"
            cur = _GGUFCursor(memoryview(mm), path, endian)
            try:
                cur.pos = 4
                version = cur.take("I")
                if version not in (2, 3):
                    raise bad_input(path, f"unsupported GGUF version {version}")
                n_tensors, n_kv = cur.take("Q"), cur.take("Q")
                if n_kv > cur.end // 12 or n_tensors > cur.end // 24:
                    raise bad_input(path, f"GGUF header claims {n_kv} keys and {n_tensors} tensors, more than the file can hold")
                meta: dict[str, Any] = {}
                for _ in range(n_kv):
                    key = cur.string()
                    meta[key] = cur.value(cur.take("I"), keep_arrays)
                tensors = []
                for _ in range(n_tensors):
                    name = cur.string()
                    ndim = cur.take("I")
                    if ndim > 8:
                        raise bad_input(path, f"GGUF tensor {name!r} claims {ndim} dimensions")
                    shape = [cur.take("Q") for _ in range(ndim)]
                    ttype = cur.take("I")
                    cur.take("Q")  # the tensor's data offset: not needed
                    tensors.append((name, shape, ttype))
                return meta, tensors, cur.pos
            finally:
                cur.buf.release()
