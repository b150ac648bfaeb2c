import re
import shutil
from pathlib import Path

from services.common.protogen import PROTO_ROOT, check


def test_committed_generated_code_is_current() -> None:
    assert check() == []


def test_drift_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(PROTO_ROOT, root)
    proto = root / "pdserve" / "v1" / "generation.proto"
    proto.write_text(proto.read_text().replace("uint32 generated_tokens = 4;",
                                               "uint32 generated_tokens = 4;\n  uint32 extra = 99;"))
    assert "generation_pb2.py" in check(root)


def test_another_generator_release_is_not_drift(tmp_path: Path) -> None:
    """A grpcio-tools or protobuf release that only restamps its version is not drift (a new
    release on the index once failed `make test` with nothing in the project changed); a
    changed line beside the stamp still is."""
    root = tmp_path / "protos"
    shutil.copytree(PROTO_ROOT, root)
    package = root / "pdserve" / "v1"
    grpc_file, pb_file = package / "control_pb2_grpc.py", package / "control_pb2.py"
    text = grpc_file.read_text()
    restamped = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.99.0'", text)
    assert restamped != text
    grpc_file.write_text(restamped)
    pb_text = pb_file.read_text()
    pb_file.write_text(re.sub(r"# Protobuf Python Version: .*", "# Protobuf Python Version: 9.0.0",
                              re.sub(r"(Domain\.PUBLIC,\s*)\d+", r"\g<1>9", pb_text)))
    assert check(root) == []
    grpc_file.write_text(restamped.replace("class ControlStub", "class ControlStubRenamed"))
    assert check(root) == ["control_pb2_grpc.py"]


def test_tunables_are_optional() -> None:
    """An explicit temperature=0 must survive the wire (proto3 `optional`)."""
    from pdserve.v1 import generation_pb2 as pb

    params = pb.SamplingParams(temperature=0.0)
    decoded = pb.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and not decoded.HasField("top_p")
