"""Writes the generated seed corpora of the fuzz targets (see fuzz/README.md).

Usage: .tools/venv/bin/python fuzz/seeds.py   (needs Python hpack 4.1.0, which `cargo xtask install`
installs into .tools/venv)

hpack_decode       header blocks as gRPC clients and servers send them (tonic, grpc-go, grpcurl,
                   grpc-java, Python grpcio), several per file sharing the dynamic table; each
                   block is a 2-byte big-endian length and the block
authority_reencode one byte choosing how the connection arrives, then a client's frames after the
                   preface: SETTINGS, WINDOW_UPDATE, HEADERS (padded, with priority, split over
                   CONTINUATION) and DATA
token_open         operation tokens sealed with the target's key (driver_sdk::fuzzing::TOKEN_KEY)
"""

import hashlib
import hmac
import json
import os
import struct

import hpack

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN_KEY = b"fuzzing-token-key-0123456789abcdef"
TOKEN_DRIVER = "fuzz.example.com"


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def request(authority, path, user_agent, extra=()):
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("user-agent", user_agent),
        ("te", "trailers"),
        *extra,
    ]


CLIENTS = {
    # name: (authority, user agent, extra headers)
    "tonic": ("localhost", "tonic/0.14.2", [("grpc-timeout", "10000000u"), ("x-request-id", "req-1")]),
    "grpc-go": ("localhost", "grpc-go/1.72.0", [("grpc-timeout", "9999926u")]),
    "grpcurl": ("/run/machine-driver/driver.sock", "grpcurl/v1.8.6 grpc-go/1.44.1-dev", []),
    "grpcio": ("%2Frun%2Fmachine-driver%2Fdriver.sock", "grpc-python/1.71.0 grpc-c/46.0.0 (linux; chttp2)",
               [("grpc-accept-encoding", "identity,deflate,gzip"), ("accept-encoding", "identity,gzip")]),
    "grpc-java": ("/tmp/a dir/@sock", "grpc-java-netty/1.70.0", [("authorization", "Bearer s3cr3t")]),
}


def blocks(encoder, header_lists, huffman=True):
    out = b""
    for headers in header_lists:
        block = encoder.encode(headers, huffman=huffman)
        out += struct.pack(">H", len(block)) + block
    return out


def frame(kind, flags, stream, payload):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_seeds():
    methods = ["/machinedriver.v1.Machines/CreateMachine", "/machinedriver.v1.Operations/GetOperation",
               "/grpc.health.v1.Health/Check"]
    for name, (authority, agent, extra) in CLIENTS.items():
        e = hpack.Encoder()
        lists = [request(authority, m, agent, extra) for m in methods]
        write("hpack_decode", f"{name}-requests", blocks(e, lists, huffman=name != "grpc-java"))
    # Responses and trailers as tonic sends them.
    e = hpack.Encoder()
    write("hpack_decode", "tonic-response", blocks(e, [
        [(":status", "200"), ("content-type", "application/grpc"), ("x-request-id", "req-1")],
        [("grpc-status", "0")],
        [(":status", "200"), ("content-type", "application/grpc")],
        [("grpc-status", "5"), ("grpc-message", "machine%20m1%20not%20found"),
         ("grpc-status-details-bin", "CAUSEm1hY2hpbmUgbTEgbm90IGZvdW5k")],
    ]))
    # A table size update (and its eviction), then a request, and never-indexed fields.
    e = hpack.Encoder()
    e.header_table_size = 256
    first = blocks(e, [request("localhost", methods[0], "tonic/0.14.2")])
    e.header_table_size = 4096
    write("hpack_decode", "table-size-updates",
          first + blocks(e, [request("localhost", methods[1], "tonic/0.14.2",
                                     [hpack.NeverIndexedHeaderTuple("authorization", "Bearer x")])]))
    # RFC 7541 C.4: three requests, Huffman-coded.
    write("hpack_decode", "rfc7541-c4", b"".join(struct.pack(">H", len(b)) + b for b in [
        bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"),
        bytes.fromhex("828684be5886a8eb10649cbf"),
        bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"),
    ]))


def authority_seeds():
    settings = frame(0x4, 0, 0, bytes.fromhex("000300000064000400400000"))
    window = frame(0x8, 0, 0, struct.pack(">I", 1 << 20))
    message = frame(0x0, 0x1, 1, b"\x00\x00\x00\x00\x05\x0a\x03abc")
    for seed, (name, (authority, agent, extra)) in enumerate(CLIENTS.items()):
        e = hpack.Encoder()
        b1 = e.encode(request(authority, "/machinedriver.v1.Machines/CreateMachine", agent, extra))
        b3 = e.encode(request(authority, "/machinedriver.v1.Operations/GetOperation", agent, extra))
        wire = settings + window + frame(0x1, 0x4, 1, b1) + message
        if seed % 2:
            # Split over CONTINUATION, padded, with priority.
            half = len(b3) // 2
            wire += frame(0x1, 0x8 | 0x20, 3, b"\x02" + b"\x00\x00\x00\x00\x0f" + b3[:half] + b"\x00\x00")
            wire += frame(0x9, 0x4, 3, b3[half:])
        else:
            wire += frame(0x1, 0x4 | 0x1, 3, b3)
        wire += frame(0x6, 0, 0, b"12345678")
        write("authority_reencode", f"{name}-connection", bytes([seed * 37 % 256]) + wire)
    # A client that sends a 4 KB header and then names it again: the re-encoded block grows.
    e = hpack.Encoder()
    big = request("localhost", "/grpc.health.v1.Health/Check", "tonic/0.14.2", [("x-big", "b" * 3000)])
    b1 = e.encode(big)
    b2 = e.encode(big + [("x-big", "b" * 3000)] * 8)
    write("authority_reencode", "repeated-large-field", b"\x06" + frame(0x1, 0x5, 1, b1) + frame(0x1, 0x5, 3, b2))


def seal(payload):
    body = b"\x01" + json.dumps(payload, separators=(",", ":")).encode()
    return body + hmac.new(TOKEN_KEY, body, hashlib.sha256).digest()


def token_seeds():
    write("token_open", "create-machine", seal(
        {"d": TOKEN_DRIVER, "n": "create-1b4e28ba", "k": "CreateMachine", "t": "m1", "s": 1764028800000,
         "st": {"id": "op-7", "zone": "zone-a"}}))
    write("token_open", "apply-pool", seal(
        {"d": TOKEN_DRIVER, "n": "apply-pool-9", "k": "ApplyPool", "t": "pool-a",
         "st": {"attempt": 2, "instances": ["i-1", "i-2"], "ratio": 0.5, "ready": True}}))
    write("token_open", "foreign-driver", seal(
        {"d": "other.example.com", "n": "x", "k": "DeletePool", "t": "p", "st": None}))
    write("token_open", "version-2", b"\x02" + seal({"d": TOKEN_DRIVER, "n": "x", "k": "DeletePool", "t": "p",
                                                     "st": None})[1:])
    write("token_open", "garbage", b"hello world, this is not a token at all!!")


if __name__ == "__main__":
    assert hpack.__version__ == "4.1.0", hpack.__version__
    hpack_seeds()
    authority_seeds()
    token_seeds()
