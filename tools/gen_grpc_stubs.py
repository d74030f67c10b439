"""Regenerate edge_batcher/transports/grpc_v2/*_pb2.py from the KServe v2 / Triton protos beside them.

    .venv/bin/pip install grpcio-tools && .venv/bin/python tools/gen_grpc_stubs.py

The protos are Triton's (triton-inference-server/common, protobuf/, BSD-3-Clause), which are
KServe v2's `inference.GRPCInferenceService` plus Triton's extensions (ModelConfig, statistics,
repository). The generated modules are shipped, so installing the `grpc` extra needs no
compiler; the .pyi beside them type the messages for mypy. Two edits after protoc: the modules
register their messages in a private descriptor pool (grpc_v2/pool.py), so a process that also
imports tritonclient.grpc's copies of the same messages does not clash in protobuf's default
pool; and model_config_pb2 is imported relative to the package. No gRPC service stubs are
generated: the server registers its handlers itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PACKAGE = Path(__file__).resolve().parents[1] / "edge_batcher" / "transports" / "grpc_v2"
PROTOS = PACKAGE / "proto"


def main() -> int:
    for name in ("model_config.proto", "grpc_service.proto"):
        rc = protoc.main(["protoc", f"-I{PROTOS}", f"--python_out={PACKAGE}", f"--pyi_out={PACKAGE}",
                          str(PROTOS / name)])
        if rc != 0:
            print(f"protoc failed on {name}", file=sys.stderr)
            return rc
    for module in ("model_config_pb2.py", "grpc_service_pb2.py", "grpc_service_pb2.pyi"):
        path = PACKAGE / module
        text = path.read_text()
        text = text.replace("from google.protobuf import descriptor_pool as _descriptor_pool\n",
                            "from .pool import POOL\n")
        text = text.replace("_descriptor_pool.Default().AddSerializedFile(", "POOL.AddSerializedFile(")
        text = re.sub(r"^import model_config_pb2 as", "from . import model_config_pb2 as", text, flags=re.M)
        path.write_text(text)
    print(f"wrote {PACKAGE}/model_config_pb2.py[i] and grpc_service_pb2.py[i]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
