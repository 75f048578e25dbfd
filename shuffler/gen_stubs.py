"""Regenerate ``shuffler_pb2.py`` and ``shuffler_pb2_grpc.py`` from ``shuffler.proto``.

Run ``python -m shuffler.gen_stubs`` (needs grpcio-tools, a test extra). The generated files are committed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    """Run protoc (from grpcio-tools) on shuffler.proto, writing the stubs next to it."""
    from grpc_tools import protoc  # imported here: grpcio-tools is only needed to regenerate

    here = Path(__file__).resolve().parent
    root = here.parent
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--grpc_python_out={root}",
            str(Path("shuffler") / "shuffler.proto"),
        ]
    )
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
