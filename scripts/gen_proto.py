"""Regenerate clients/protocol/*_pb2*.py from proto/ (needs grpcio-tools==1.84.0, the test extra).

The gencode is committed so that the server imports without grpcio-tools. It is produced by grpcio-tools 1.84
(protobuf 7.35 gencode), so it imports on grpcio >= 1.84 and protobuf 7.x. tests/test_proto_gencode.py checks
that the committed files match what this script produces.

    python scripts/gen_proto.py            # rewrite clients/protocol/
    python scripts/gen_proto.py --out DIR  # write elsewhere (the test uses this)
"""
import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTOS = ["drafter/v1/drafter.proto"]
DEFAULT_OUT = ROOT / "clients" / "protocol"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    out_dir = pathlib.Path(out_dir)
    tmp = out_dir / "_gen_tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    include = str(pathlib.Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"]
    if protoc.main(args + [str(PROTO_DIR / p) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for src in sorted(tmp.rglob("*.py*")):
        text = src.read_text()
        # protoc writes absolute imports (`from drafter.v1 import drafter_pb2`); make them package-relative.
        text = re.sub(r"^from drafter\.v1 import (\w+) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)
        dst = out_dir / src.name
        dst.write_text(text)
        written.append(dst)
    for p in sorted(tmp.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    tmp.rmdir()
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    for p in generate(a.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
