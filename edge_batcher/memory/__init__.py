"""Device memory: probes (what is free), the budget (what the scheduler may plan with) and the
ONNX footprint estimator (what a batch needs).

Import the submodules directly (``edge_batcher.memory.probe``, ``.budget``, ``.estimator``):
this package imports nothing itself, so using the probes does not pull in onnx.
"""
