"""Compressed.to_bytes / from_bytes: round trip, and ValueError (never a crash) on bad bytes."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import taco_triton as taco
from taco_triton.compressed import Compressed
from taco_triton.layout import WireLayout

from .helpers import make_input

CONFIGS = [taco.CompressionConfig(), taco.CompressionConfig(codec="int8", group_size=32, hadamard=False),
           taco.CompressionConfig(scales="taco_fp32x2", rounding="stochastic", seed=9),
           taco.CompressionConfig(codec="int6", group_size=32), taco.CompressionConfig(codec="int4", hadamard=False)]


def _blob(cfg=CONFIGS[0], shape=(3, 130), dtype=torch.bfloat16) -> bytes:
    return taco.compress(make_input("outliers", shape, dtype), cfg).to_bytes()


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "int8-G32", "fp32x2-SR", "int6-G32", "int4-noH"])
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
    blob = bytearray(_blob(CONFIGS[data.draw(st.integers(0, len(CONFIGS) - 1))]))
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


def test_blobs_written_before_the_sub_byte_codecs_still_read():
    """Codec ids are indices into CODECS, which only grows at its end: a blob of every 8-bit codec
    written by a build without int6/int4 (its header bytes fixed here) reads back unchanged."""
    import struct
    import zlib

    data = taco.compress(make_input("dense", (2, 64), torch.float32), taco.CompressionConfig(codec="int8")).data
    # magic, version 1, codec 2 (int8), G 128, hadamard, dual, nearest, seed 0, fp32, 4096, ndim 2
    head = b"TACO\x01\x02\x80\x00\x01\x00\x00" + bytes(4) + b"\x02\x00\x10\x00\x00\x02"
    head += struct.pack("<qqQ", 2, 64, data.numel())
    body = head + data.numpy().tobytes()
    c = taco.Compressed.from_bytes(body + struct.pack("<I", zlib.crc32(body)))
    assert c.config == taco.CompressionConfig(codec="int8") and c.dtype == torch.float32 and torch.equal(c.data, data)


@pytest.mark.parametrize("codec,code", [("int6", -32), ("int4", -8)])
def test_sub_byte_code_compress_never_writes_is_rejected(codec, code):
    """The integer codecs are symmetric: the most negative code in a packed word is invalid."""
    from taco_triton import reference as ref
    from taco_triton.layout import WireLayout

    cfg = taco.CompressionConfig(codec=codec, group_size=32)
    c = taco.compress(make_input("dense", (2, 64), torch.float32), cfg)
    codes = ref.unpack_codes(WireLayout.of(c.numel, cfg).split(c.data)[0], cfg.spec.bits)
    codes[1, 5] = code & 0xFF
    data = c.data.clone()
    WireLayout.of(c.numel, cfg).split(data)[0].copy_(ref.pack_codes(codes, cfg.spec.bits))
    with pytest.raises(ValueError, match=f"invalid codes.*{codec}.*element {32 + 5}"):
        taco.Compressed(data, c.shape, c.dtype, cfg).validate()


def _cut_at_odd_offset(c: Compressed) -> Compressed:
    buf = torch.zeros(c.nbytes + 3, dtype=torch.uint8)
    buf[3:] = c.data
    return c._replace(data=buf[3:])


def test_compressed_data_at_an_odd_offset_decompresses():
    x = torch.randn(5000)
    c = taco.compress(x, backend="torch")
    odd = _cut_at_odd_offset(c)
    assert odd.data.data_ptr() % 4
    odd.validate()
    assert torch.equal(taco.decompress(odd, backend="torch"), taco.decompress(c, backend="torch"))


def test_compressed_strided_data_is_a_value_error_or_copied():
    c = taco.compress(torch.randn(300), backend="torch")
    strided = torch.zeros(2 * c.nbytes, dtype=torch.uint8)[::2]
    strided.copy_(c.data)
    assert torch.equal(taco.decompress(c._replace(data=strided), backend="torch"), taco.decompress(c, backend="torch"))
    with pytest.raises(ValueError, match="1-D uint8"):
        c._replace(data=c.data.view(2, -1) if c.nbytes % 2 == 0 else c.data[None]).validate()


def test_header_with_a_shape_whose_strides_overflow_is_rejected():
    c = Compressed(torch.empty(0, dtype=torch.uint8), torch.Size([0, 2**62, 4]), torch.float32, taco.CompressionConfig())
    with pytest.raises(ValueError, match="exceeds 2\\*\\*63"):
        Compressed.from_bytes(c.to_bytes())


@pytest.mark.parametrize("codec,code", [("fp8_e4m3", 0x7F), ("fp8_e4m3", 0xFF), ("int8", 0x80),
                                        ("fp8_e5m2", 0x7C), ("fp8_e5m2", 0xFF)])
def test_validate_rejects_codes_compress_never_writes(codec, code):
    cfg = taco.CompressionConfig(codec=codec)
    x = torch.randn(4096)
    x[::97] *= 1e4
    x[5] = float("nan")
    c = taco.compress(x, cfg, backend="torch")
    c.validate()  # what compress writes (outliers, a NaN group) passes
    codes, _, _ = WireLayout.of(c.numel, cfg).split(c.data)
    codes.view(-1)[200] = code
    with pytest.raises(ValueError, match="codes compress never writes"):
        c.validate()
    with pytest.raises(ValueError, match="codes compress never writes"):
        Compressed.from_bytes(c.to_bytes())
