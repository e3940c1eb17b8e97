"""The independent side of tests/hpack_interop.rs: Python hpack (PyPI, pinned in xtask/src/main.rs).

Reads one JSON request on stdin, writes one JSON answer on stdout. Bytes travel as hex.
  {"op": "encode", "connections": [[{"table_sizes": [N...], "huffman": B,
                                     "fields": [[name, value, mode]]}]]}
      encodes each connection's blocks with one Encoder (mode: "index" = literal with
      incremental indexing or indexed, "never" = never indexed, "none" = literal without
      indexing; table_sizes: dynamic table size changes announced before the block), and decodes
      them again with one Decoder: [[{"block": hex, "decoded": [[name, value, never]]} or
      {"block": hex, "error": text}]]
  {"op": "decode", "connections": [[block]]}
      decodes each connection's blocks with one Decoder: [[{"decoded": ...} or {"error": ...}]]
"""

import json
import sys

import hpack
from hpack.hpack import INDEX_NONE


def decoder():
    return hpack.Decoder(max_header_list_size=1 << 24)


def decode_block(d, block):
    try:
        fields = d.decode(block, raw=True)
    except hpack.HPACKError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"decoded": [[n.hex(), v.hex(), isinstance(f, hpack.NeverIndexedHeaderTuple)]
                        for f in fields for n, v in [f]]}


def without_indexing(e, name, value, huffman):
    match = e.header_table.search(name, value)
    if match is None:
        return e._encode_literal(name, value, INDEX_NONE, huffman)
    index, _, _ = match
    return e._encode_indexed_literal(index, value, INDEX_NONE, huffman)


def encode(connections):
    out = []
    for blocks in connections:
        e, d, answers = hpack.Encoder(), decoder(), []
        for spec in blocks:
            for size in spec["table_sizes"]:
                e.header_table_size = size
            huffman = spec["huffman"]
            # encode([]) is just the pending table size updates.
            parts = [e.encode([], huffman=huffman)]
            for name, value, mode in spec["fields"]:
                name, value = bytes.fromhex(name), bytes.fromhex(value)
                if mode == "none":
                    parts.append(without_indexing(e, name, value, huffman))
                else:
                    parts.append(e.add((name, value), mode == "never", huffman))
            block = b"".join(parts)
            answers.append({"block": block.hex(), **decode_block(d, block)})
        out.append(answers)
    return out


def decode(connections):
    out = []
    for blocks in connections:
        d = decoder()
        out.append([decode_block(d, bytes.fromhex(b)) for b in blocks])
    return out


if __name__ == "__main__":
    assert hpack.__version__ == "4.1.0", f"hpack {hpack.__version__}, expected 4.1.0"
    request = json.load(sys.stdin)
    op = {"encode": encode, "decode": decode}[request["op"]]
    json.dump({"connections": op(request["connections"])}, sys.stdout)
