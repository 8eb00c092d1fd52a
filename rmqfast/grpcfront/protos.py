"""The ``apache.rocketmq.v2`` wire API, taken from a published artifact at import time.

Where the descriptors come from: Apache's ``rocketmq-python-client`` wheel on PyPI ships the
``apache/rocketmq-apis`` protos compiled (``rocketmq/grpc_protocol/{definition,service}_pb2.py``,
each holding its ``FileDescriptorProto`` as one serialized literal).  The Maven artifact
``org.apache.rocketmq:rocketmq-proto`` holds generated Java classes only (its ``-sources`` jar the
generated ``.java``), no ``.proto`` file, so it would need a class-file reader to get at them.

The pb2 modules are *not* imported: importing anything under ``rocketmq`` runs the client
package's ``__init__`` (the whole client, OpenTelemetry included: about 1.5 s and 10 MB per
process) and checks its own protobuf runtime version.  Instead the serialized descriptors are read
out of the installed files (``ast.literal_eval`` of the literal, no code executed), added to a
private :class:`~google.protobuf.descriptor_pool.DescriptorPool` and turned into message classes
there, so a process that also runs the real client keeps the two apart.
"""

from __future__ import annotations

import ast
import importlib.metadata
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2, message_factory, timestamp_pb2

DISTRIBUTION = "rocketmq-python-client"
PACKAGE = "apache.rocketmq.v2"
SERVICE = f"{PACKAGE}.MessagingService"
_FILES = ("definition_pb2.py", "service_pb2.py")


class ProtosMissing(RuntimeError):
    """The distribution that carries the v2 descriptors is not installed (``pip install rmqfast[grpc]``)."""


def _serialized_descriptor(path: Path) -> bytes:
    """The bytes literal passed to ``AddSerializedFile`` in a generated ``*_pb2.py``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "AddSerializedFile" and node.args):
            value = ast.literal_eval(node.args[0])
            if isinstance(value, bytes):
                return value
    raise ProtosMissing(f"{path}: no serialized descriptor found")


def _locate() -> list[Path]:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ProtosMissing(f"{DISTRIBUTION} is not installed (pip install 'rmqfast[grpc]')") from exc
    found: dict[str, Path] = {}
    for f in dist.files or ():
        if f.parent.name == "grpc_protocol" and f.name in _FILES:
            found[f.name] = Path(str(dist.locate_file(f)))
    missing = [n for n in _FILES if n not in found]
    if missing:
        raise ProtosMissing(f"{DISTRIBUTION} has no grpc_protocol/{', '.join(missing)}")
    return [found[n] for n in _FILES]


@cache
def load() -> SimpleNamespace:
    """Message classes and enum values of ``apache.rocketmq.v2`` by short name (``pb.SendMessageRequest``,
    ``pb.Code.OK``...), plus ``pb.service`` (the service descriptor) and ``pb.Duration``/``pb.Timestamp``."""
    pool = descriptor_pool.DescriptorPool()
    for wkt in (duration_pb2, timestamp_pb2):
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(wkt.DESCRIPTOR.serialized_pb))
    files = []
    for path in _locate():
        fdp = descriptor_pb2.FileDescriptorProto.FromString(_serialized_descriptor(path))
        pool.Add(fdp)
        files.append(pool.FindFileByName(fdp.name))
    ns: dict[str, Any] = {}
    for fd in files:
        for name, desc in fd.message_types_by_name.items():
            ns[name] = message_factory.GetMessageClass(desc)
        for name, enum in fd.enum_types_by_name.items():
            ns[name] = SimpleNamespace(**{v.name: v.number for v in enum.values},
                                       Name=lambda n, e=enum: e.values_by_number[n].name if n in e.values_by_number
                                       else str(n))
    ns["Duration"] = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.Duration"))
    ns["Timestamp"] = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.Timestamp"))
    ns["service"] = pool.FindServiceByName(SERVICE)
    return SimpleNamespace(**ns)
