"""Compressed.to_bytes / from_bytes: round trip, and ValueError (never a crash) on bad bytes."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import taco_triton as taco

from .helpers import make_input

CONFIGS = [taco.CompressionConfig(), taco.CompressionConfig(codec="int8", group_size=32, hadamard=False),
           taco.CompressionConfig(scales="taco_fp32x2", rounding="stochastic", seed=9)]


def _blob(cfg=CONFIGS[0], shape=(3, 130), dtype=torch.bfloat16) -> bytes:
    return taco.compress(make_input("outliers", shape, dtype), cfg).to_bytes()


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "int8-G32", "fp32x2-SR"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 130), (2, 3, 4, 5)], ids=str)
def test_round_trip(cfg, shape):
    x = make_input("dense", shape, torch.float16) if 0 not in shape else torch.empty(shape, dtype=torch.float16)
    c = taco.compress(x, cfg)
    c2 = taco.Compressed.from_bytes(c.to_bytes())
    assert torch.equal(c2.data, c.data.cpu()) and c2.shape == c.shape and c2.dtype == c.dtype and c2.config == cfg
    assert torch.equal(taco.decompress(c2), taco.decompress(c).cpu())


def test_truncated_foreign_and_corrupted():
    blob = _blob()
    for cut in (0, 3, 10, 40, len(blob) // 2, len(blob) - 1):
        with pytest.raises(ValueError, match="truncated"):
            taco.Compressed.from_bytes(blob[:cut])
    with pytest.raises(ValueError, match="magic"):
        taco.Compressed.from_bytes(b"PK\x03\x04" + blob[4:])
    bad = bytearray(blob)
    bad[len(blob) // 2] ^= 0x10
    with pytest.raises(ValueError, match="CRC32"):
        taco.Compressed.from_bytes(bytes(bad))
    with pytest.raises(ValueError, match="padded"):
        taco.Compressed.from_bytes(blob + b"\0")


def test_valid_crc_but_impossible_scales_is_rejected():
    import struct
    import zlib

    c = taco.compress(make_input("dense", (4, 128), torch.float32))
    data = c.data.clone()
    data[-1] = 250  # an E4M4 group-scale code compress never writes (241..254)
    blob = taco.Compressed(data, c.shape, c.dtype, c.config).to_bytes()
    with pytest.raises(ValueError, match="bad group scales"):
        taco.Compressed.from_bytes(blob)
    body = bytearray(_blob()[:-4])
    body[5] = 9  # codec id out of range, CRC recomputed: a well-formed but foreign header
    with pytest.raises(ValueError, match="corrupt taco_triton header"):
        taco.Compressed.from_bytes(bytes(body) + struct.pack("<I", zlib.crc32(body)))


@given(data=st.data())
def test_fuzz_mutations_raise_value_error(data):
    blob = bytearray(_blob(CONFIGS[data.draw(st.integers(0, 2))]))
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "random", "splice"]))
    if op == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif op == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif op == "extend":
        blob += data.draw(st.binary(min_size=1, max_size=64))
    elif op == "random":
        blob = bytearray(b"TACO" + data.draw(st.binary(max_size=256)))
    else:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    with pytest.raises(ValueError):
        taco.Compressed.from_bytes(bytes(blob))
