"""Static checks on the shuffler package: no non-cryptographic RNG, no torch/flwr, stubs match the .proto."""

from __future__ import annotations

import ast
from pathlib import Path

from shuffledp import shuffler

PKG = Path(shuffler.__file__).resolve().parent
SOURCES = [p for p in PKG.glob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_random_or_numpy_random_torch_flwr() -> None:
    assert len(SOURCES) >= 8
    for path in SOURCES:
        imports = _imports(path)
        for banned in ("random", "numpy.random", "torch", "flwr"):
            assert not any(i == banned or i.startswith(banned + ".") for i in imports), (path.name, banned)
        text = path.read_text()
        assert "np.random" not in text and "numpy.random" not in text, path.name


def test_generated_stubs_match_the_proto() -> None:
    from google.protobuf import descriptor_pb2

    from shuffledp.shuffler import shuffler_pb2

    fd = descriptor_pb2.FileDescriptorProto()
    shuffler_pb2.DESCRIPTOR.CopyToProto(fd)
    proto = (PKG / "shuffler.proto").read_text()
    for msg in fd.message_type:
        assert f"message {msg.name} {{" in proto
        for field in msg.field:
            assert f"{field.name} = {field.number}" in proto, (msg.name, field.name)
    for method in fd.service[0].method:
        assert f"rpc {method.name}(" in proto
