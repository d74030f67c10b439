"""The KServe v2 gRPC endpoint (`inference.GRPCInferenceService`), an optional extra.

`pip install 'edge-batcher[grpc]'` adds protobuf and hpack (http2.py speaks gRPC's HTTP/2 itself,
without grpcio); nothing here is imported unless
`[server] grpc` names an address, so a daemon without it does not load them (or pay their
memory). server.py serves the RPCs through the same runtime and error tree as HTTP; codec.py
turns messages into decoded requests and outputs back; the *_pb2 modules are generated from
the protos in proto/ by tools/gen_grpc_stubs.py.
"""
