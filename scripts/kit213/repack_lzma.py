"""Repack a wheel: members that DEFLATE already shrinks well (compressed/original < --ratio, i.e. host code,
Python, text) are re-compressed with LZMA (zip method 14, which pip's zipfile reads); the others (CUDA
device code, already-compressed fatbins, where LZMA gains ~1-5% at ~3 MB/s) are copied as they are,
byte for byte, without being decompressed. File contents are unchanged, so the wheel's RECORD hashes stay
valid. Prints one line: name, size before, size after, members re-compressed, seconds.

Usage: python3 repack_lzma.py SRC.whl DST.whl [--preset 6] [--ratio 0.6] [--min-bytes 4096]
"""
from __future__ import annotations

import argparse
import lzma
import os
import struct
import time
import zipfile


def lzma_compressor_class(preset: int):
    """zipfile's LZMA compressor with another preset (zipfile always uses preset 6)."""

    class Compressor(zipfile.LZMACompressor):
        def _init(self):
            props = lzma._encode_filter_properties({"id": lzma.FILTER_LZMA1, "preset": preset})
            self._comp = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[
                lzma._decode_filter_properties(lzma.FILTER_LZMA1, props)])
            return struct.pack("<BBH", 9, 4, len(props)) + props

    return Compressor


def raw_member(src, info: zipfile.ZipInfo) -> bytes:
    """The compressed bytes of one member, read straight from the archive."""
    src.seek(info.header_offset)
    header = src.read(30)
    if header[:4] != b"PK\x03\x04":
        raise ValueError(f"bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    src.seek(info.header_offset + 30 + name_len + extra_len)
    return src.read(info.compress_size)


def copy_raw(zout: zipfile.ZipFile, info: zipfile.ZipInfo, data: bytes) -> None:
    """Append an already-compressed member (same method, CRC and sizes) to zout."""
    zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    zi.compress_type = info.compress_type
    zi.external_attr, zi.create_system = info.external_attr, info.create_system
    zi.CRC, zi.compress_size, zi.file_size = info.CRC, info.compress_size, info.file_size
    zi.flag_bits = info.flag_bits & ~0x08  # sizes are in the local header: no data descriptor
    zi.header_offset = zout.fp.tell()
    zip64 = zi.file_size > zipfile.ZIP64_LIMIT or zi.compress_size > zipfile.ZIP64_LIMIT
    zout.fp.write(zi.FileHeader(zip64))
    zout.fp.write(data)
    zout.filelist.append(zi)
    zout.NameToInfo[zi.filename] = zi
    zout.start_dir = zout.fp.tell()
    zout._didModify = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--preset", type=int, default=6)
    parser.add_argument("--ratio", type=float, default=0.6)
    parser.add_argument("--min-bytes", type=int, default=4096)
    args = parser.parse_args()
    zipfile.LZMACompressor = lzma_compressor_class(args.preset)
    t0, n_lzma = time.time(), 0
    with zipfile.ZipFile(args.src) as zin, open(args.src, "rb") as raw, zipfile.ZipFile(args.dst, "w") as zout:
        for info in zin.infolist():
            compressible = (info.file_size >= args.min_bytes and info.compress_type == zipfile.ZIP_DEFLATED
                            and info.compress_size < args.ratio * info.file_size)
            if not compressible:
                copy_raw(zout, info, raw_member(raw, info))
                continue
            zi = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            zi.external_attr, zi.create_system = info.external_attr, info.create_system
            zout.writestr(zi, zin.read(info), compress_type=zipfile.ZIP_LZMA)
            n_lzma += 1
    # Check: every member reads back (CRC-checked) would cost a full decompression; check the directory.
    with zipfile.ZipFile(args.dst) as check:
        names = check.namelist()
    with zipfile.ZipFile(args.src) as zin:
        if names != zin.namelist():
            raise SystemExit(f"repack of {args.src}: member list differs")
    before, after = os.path.getsize(args.src), os.path.getsize(args.dst)
    print(f"{os.path.basename(args.src)} {before} {after} lzma_members={n_lzma} seconds={time.time() - t0:.0f}")


if __name__ == "__main__":
    main()
