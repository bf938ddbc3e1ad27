"""Read what a W&B run wrote to its offline file (run-<id>.wandb), without a server.

The file is wandb's transaction log: a 7-byte header (":W&B", magic 0xBEE1,
version 0), then LevelDB's log format (32 KiB blocks; each record a 4-byte
CRC, a 2-byte little-endian length and a type: FULL 1, FIRST 2, MIDDLE 3,
LAST 4; a block's tail of under 7 bytes is padding), each record's payload a
``wandb_internal_pb2.Record``, the protobuf wandb itself writes and syncs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Iterator, List

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, path
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:  # padding
            pos += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:  # zero fill at the end of a block
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0


def records(path: Path) -> Dict[str, List]:
    """{"history": [{key: value, "_step": n}, ...], "config", "summary", "run_id", "artifacts": [[path, ...]]}."""
    from wandb.proto import wandb_internal_pb2

    out: Dict = {"history": [], "config": {}, "summary": {}, "run_id": None, "artifacts": []}
    for payload in payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "config":
            out["config"].update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                  for i in record.config.update})
        elif kind == "summary":
            out["summary"].update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                                   for i in record.summary.update})
        elif kind == "run":
            out["run_id"] = record.run.run_id
        elif kind == "artifact":
            out["artifacts"].append([entry.path for entry in record.artifact.manifest.contents])
    return out
