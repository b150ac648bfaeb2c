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
                                               "uint32 generated_tokens = 4;\n  uint32 extra = 5;"))
    assert "generation_pb2.py" in check(root)


def test_tunables_are_optional() -> None:
    """An explicit temperature=0 must survive the wire (proto3 `optional`)."""
    from pdserve.v1 import generation_pb2 as pb

    params = pb.SamplingParams(temperature=0.0)
    decoded = pb.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField("temperature") and not decoded.HasField("top_p")
