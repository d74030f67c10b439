"""A peer's answer, shaped like the local model's: an offloaded request gets the outputs it
would have got here.

v2 servers differ in small ways that change what a client receives: MLServer's NumpyCodec
turns a 1-D output of shape [n] into [n, 1] (seen against MLServer 1.7.1), and another build
of the model on the peer (TensorRT, say) may answer INT32 where ONNX Runtime here answers
INT64. Each output is brought to the model's declared shape (batch dimension = the request's
rows) when the two differ only by dimensions of size 1, and to its datatype when numpy casts
it within the same kind; anything else is a mismatch between the two models, answered as an
error naming the output, never passed on silently. `spec_mismatches` applies the same rules
ahead of time, to a peer's model metadata.
"""

from __future__ import annotations

import numpy as np

from ..types import DATATYPE_TO_NUMPY, TensorSpec
from .client import PeerError


def conform_outputs(outputs: dict[str, np.ndarray], specs: list[TensorSpec], rows: int,
                    peer: str, model: str) -> dict[str, np.ndarray]:
    """`outputs` with every declared output shaped and typed as `specs` says (outputs the
    model does not declare are kept as they are). Raises PeerError on a real mismatch."""
    conformed = dict(outputs)
    for spec in specs:
        array = outputs.get(spec.name)
        if array is None:
            continue  # not asked for (the request named its outputs); a missing one the codec reports
        conformed[spec.name] = _conform(array, spec, rows, f"peer {peer}: model {model!r} output {spec.name!r}")
    return conformed


def _conform(array: np.ndarray, spec: TensorSpec, rows: int, what: str) -> np.ndarray:
    want = DATATYPE_TO_NUMPY[spec.datatype]
    if array.dtype != want and want != np.dtype(object):
        if not np.can_cast(array.dtype, want, casting="same_kind"):
            raise _mismatch(what, f"datatype {array.dtype} where the model answers {spec.datatype}")
        array = array.astype(want)
    dims = spec.shape[1:]
    if not array.ndim or array.shape[0] != rows:
        raise _mismatch(what, f"shape {list(array.shape)} for a request of {rows} row(s)")
    if array.ndim == len(dims) + 1:
        if all(d in (-1, g) for d, g in zip(dims, array.shape[1:])):
            return array
    elif _shapes_agree(list(array.shape), [rows, *dims]):
        # Another rank: only unit dimensions were added or left out ([n] vs [n, 1]).
        sizes = iter(g for g in array.shape[1:] if g != 1)
        return array.reshape((rows, *(1 if d == 1 else next(sizes) for d in dims)))
    raise _mismatch(what, f"shape {list(array.shape)} where the model answers {[rows, *dims]}")


def _mismatch(what: str, detail: str) -> PeerError:
    return PeerError(f"{what}: {detail}; the peer's model does not match this one",
                     breaker_failure=False)


def spec_mismatches(inputs: list[TensorSpec], outputs: list[TensorSpec], metadata: dict) -> list[str]:
    """What in a peer's model metadata (``GET /v2/models/{m}``) disagrees with this model's
    inputs and outputs, by the rules answers are conformed with: inputs must match in name,
    datatype and shape (up to dimensions of size 1 and -1), outputs must exist with a
    datatype castable within its kind. Empty when they agree, or when the peer does not
    describe its tensors (MLServer's custom runtimes list none)."""
    problems: list[str] = []
    for kind, specs, exact in (("input", inputs, True), ("output", outputs, False)):
        listed = metadata.get(f"{kind}s")
        if not isinstance(listed, list) or not listed:
            continue
        theirs = {t.get("name"): t for t in listed if isinstance(t, dict)}
        for spec in specs:
            tensor = theirs.get(spec.name)
            if tensor is None:
                problems.append(f"{kind} {spec.name!r} is missing (the peer's {kind}s: {', '.join(map(str, theirs))})")
                continue
            datatype, shape = tensor.get("datatype"), tensor.get("shape")
            if datatype != spec.datatype and (exact or not _castable(datatype, spec.datatype)):
                problems.append(f"{kind} {spec.name!r} is {datatype} there, {spec.datatype} here")
            if isinstance(shape, list) and not _shapes_agree(shape, list(spec.shape)):
                problems.append(f"{kind} {spec.name!r} has shape {shape} there, {list(spec.shape)} here")
    return problems


def _castable(theirs: str | None, ours: str) -> bool:
    if theirs not in DATATYPE_TO_NUMPY:
        return False
    return np.can_cast(DATATYPE_TO_NUMPY[theirs], DATATYPE_TO_NUMPY[ours], casting="same_kind")


def _shapes_agree(theirs: list, ours: list) -> bool:
    """Batch dimensions aside, equal up to dimensions of size 1, with -1 matching any size."""
    a = [d for d in theirs[1:] if d != 1]
    b = [d for d in ours[1:] if d != 1]
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))
