"""Generated protobuf/gRPC code for drafter.v1 (see scripts/gen_proto.py; do not edit the *_pb2* files)."""
from . import drafter_pb2 as pb
from . import drafter_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
