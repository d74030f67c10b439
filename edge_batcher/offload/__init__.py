"""Offloading batches to a nearby server that speaks KServe v2 (the Open Inference Protocol).

Another edge-batcher, NVIDIA Triton, MLServer or OpenVINO Model Server can take batches this
device cannot run (or cannot run in time). The pieces, one concept per module:

* ``breaker.py``: a pure, synchronous per-peer circuit breaker (closed -> open -> half-open).
* ``client.py``: :class:`PeerClient`, a lean v2 HTTP client for one peer (pooled keep-alive
  session, bearer token, TLS, binary tensor extension when the peer offers it, deadlines) and
  :class:`PeerError`, the error for "the peer could not serve this" (HTTP 502).
* ``peers.py``: :class:`PeerPool`, the ordered peers with their breakers, a periodic health
  check, and ``infer`` that tries the peers in order.
* ``conform.py``: a peer's outputs brought to the local model's shapes and datatypes (v2
  servers differ: MLServer answers [n, 1] for [n]), or an error naming the mismatch.

Which batches go to a peer is the scheduler's decision (see docs/offload.md); nothing here
decides that.
"""
