"""The descriptor pool of the generated KServe v2 / Triton messages (see tools/gen_grpc_stubs.py):
private, so tritonclient.grpc's own copies of the same messages can live in the same process."""

from google.protobuf.descriptor_pool import DescriptorPool

POOL = DescriptorPool()
