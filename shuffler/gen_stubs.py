"""Regenerate ``shuffler_pb2.py`` and ``shuffler_pb2_grpc.py`` from ``shuffler.proto``.

Run ``python -m shuffledp.shuffler.gen_stubs`` (needs grpcio-tools, a test extra). The generated files are
committed. protoc names the generated imports after the proto's path below its include root, so the proto is
compiled from a temporary ``shuffledp/shuffler/`` tree: the stubs then import ``shuffledp.shuffler.shuffler_pb2``,
the installed name, whatever the repository folder is called.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

STUBS = ("shuffler_pb2.py", "shuffler_pb2_grpc.py")


def main() -> int:
    """Run protoc (from grpcio-tools) on shuffler.proto and write the stubs next to it.

    Returns:
        protoc's exit code (0 on success); the stubs are replaced only on success.
    """
    from grpc_tools import protoc  # imported here: grpcio-tools is only needed to regenerate

    here = Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "shuffledp" / "shuffler"
        package.mkdir(parents=True)
        shutil.copyfile(here / "shuffler.proto", package / "shuffler.proto")
        rc = int(protoc.main(["grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                              str(Path("shuffledp") / "shuffler" / "shuffler.proto")]))
        if rc == 0:
            for name in STUBS:
                shutil.copyfile(package / name, here / name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
