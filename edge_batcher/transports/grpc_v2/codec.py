"""KServe v2 gRPC messages <-> the codec's decoded requests and the core's output tensors.

A ModelInferRequest's tensors are checked by the same code as HTTP's (protocol/tensor_decode.py,
through v2.decode_tensors' entry form): `raw_input_contents` are decoded like a binary tensor of
the binary extension (zero-copy), typed `contents` like a JSON tensor's data, so a bad shape,
datatype or byte count gets the same message on every transport. Parameters become plain
values for protocol/parameters.py. Outputs go back as `raw_output_contents`, as Triton does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InvalidInput
from ...protocol.binary_extension import pack_bytes_elements
from ...protocol.preview import preview
from ...protocol.tensor_decode import RegionReader, decode_tensors
from ...protocol.tensor_encode import encode_tensors
from ...protocol.v2 import DecodedRequest, RequestedOutput
from ...types import DATATYPE_TO_NUMPY
from . import grpc_service_pb2 as pb

# The typed `contents` field that carries each datatype (KServe v2's InferTensorContents).
CONTENTS_FIELDS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
    "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


def parameter_value(param: pb.InferParameter) -> Any:
    """One InferParameter as the plain value its oneof holds (None when unset)."""
    choice = param.WhichOneof("parameter_choice")
    return getattr(param, choice) if choice else None


def decode_infer_request(request: pb.ModelInferRequest, regions: RegionReader | None = None) -> DecodedRequest:
    """A ModelInferRequest as the codec's DecodedRequest (InvalidInput naming the problem); inputs
    that name a shared memory region are read by `regions` and have no raw_input_contents entry."""
    raw = request.raw_input_contents
    in_memory = [t for t in request.inputs if "shared_memory_region" not in t.parameters]
    if raw and len(raw) != len(in_memory):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(in_memory)} inputs: "
                           "give every input's data there (but those in shared memory), or none")
    inputs: dict[str, np.ndarray] = {}
    raw_index = 0
    for tensor in request.inputs:
        if tensor.name in inputs:
            raise InvalidInput(f"input {preview.repr(tensor.name)} appears twice")
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if "shared_memory_region" in tensor.parameters:
            entry["parameters"] = {key: parameter_value(p) for key, p in tensor.parameters.items()}
            inputs.update(decode_tensors([entry], "input", memoryview(b""), False, regions))
        elif raw:
            inputs.update(_decode_binary(entry, memoryview(raw[raw_index])))
            raw_index += 1
        else:
            inputs.update(_decode_contents(entry, tensor))
    outputs = [RequestedOutput(o.name, True, {key: parameter_value(p) for key, p in o.parameters.items()})
               for o in request.outputs] or None
    return DecodedRequest(
        id=request.id or None,
        inputs=inputs,
        parameters={key: parameter_value(p) for key, p in request.parameters.items()},
        outputs=outputs,
        binary_output_default=True,
    )


def _decode_binary(entry: dict[str, Any], data: memoryview) -> dict[str, np.ndarray]:
    entry["parameters"] = {"binary_data_size": len(data)}
    return decode_tensors([entry], "input", data, has_header_length=True)


def _decode_contents(entry: dict[str, Any], tensor: pb.ModelInferRequest.InferInputTensor) -> dict[str, np.ndarray]:
    where = f"input {preview.repr(entry['name'])}"
    field = CONTENTS_FIELDS.get(entry["datatype"])
    if field is None:
        if entry["datatype"] in DATATYPE_TO_NUMPY:  # FP16, BF16: no typed field in KServe v2
            raise InvalidInput(f"{where}: {entry['datatype']} data travels in raw_input_contents only")
        return decode_tensors([{**entry, "data": []}], "input", memoryview(b""), False)  # names the datatype
    if not tensor.HasField("contents"):
        raise InvalidInput(f"{where} has no data: give it in raw_input_contents or in contents.{field}")
    values = getattr(tensor.contents, field)
    if field == "bytes_contents":
        return _decode_binary(entry, memoryview(pack_bytes_elements(list(values))))
    return decode_tensors([{**entry, "data": list(values)}], "input", memoryview(b""), False)


def encode_infer_response(model: str, request_id: str | None, outputs: dict[str, np.ndarray],
                          parameters: dict[str, Any] | None,
                          without_data: list[dict[str, Any]] | None = None) -> pb.ModelInferResponse:
    """The core's outputs as a ModelInferResponse with raw_output_contents; the `without_data`
    entries (outputs written into shared memory) come last with empty contents: as Triton, every
    output has its raw_output_contents[i], which tritonclient (C++ and Python) index by position."""
    entries, chunks = encode_tensors(outputs, "output", all_binary=True, binary_names=None)
    response = pb.ModelInferResponse(model_name=model, model_version="1", id=request_id or "")
    for entry in [*entries, *(without_data or [])]:
        response.outputs.add(name=entry["name"], datatype=entry["datatype"], shape=entry["shape"])
    response.raw_output_contents.extend(chunks)
    response.raw_output_contents.extend(b"" for _ in without_data or [])
    for key, value in (parameters or {}).items():
        _set_parameter(response.parameters[key], value)
    return response


def _set_parameter(param: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = value if isinstance(value, str) else str(value)
