"""The committed gencode matches proto/ and imports; the generated modules need only grpcio >= 1.84."""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_committed_gencode_matches_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the code")
    import grpc_tools

    version = getattr(grpc_tools, "__version__", None)
    from importlib.metadata import version as dist_version

    version = dist_version("grpcio-tools")
    if version != "1.84.0":
        pytest.skip(f"gencode is pinned to grpcio-tools 1.84.0 (installed {version})")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        written = gen.generate(tmp_path)
    finally:
        sys.path.pop(0)
    assert written
    for new in written:
        committed = ROOT / "clients" / "protocol" / new.name
        assert committed.read_text() == new.read_text(), f"{committed} is stale: run python scripts/gen_proto.py"


def test_gencode_requires_only_grpcio_184():
    text = (ROOT / "clients" / "protocol" / "drafter_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.84.0'" in text
    from drafter_client.protocol import pb, pb_grpc

    assert pb.DESCRIPTOR.package == "drafter.v1"
    assert set(pb.DESCRIPTOR.services_by_name["Drafter"].methods_by_name) >= {
        "GetInfo", "Propose", "ProposeStream", "Release"}
    assert hasattr(pb_grpc, "DrafterStub")
