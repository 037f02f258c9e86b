"""gRPC/protobuf definitions of pdserve; see protos/README.md."""
