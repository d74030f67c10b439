"""An MLServer custom runtime serving an ONNX model with ONNX Runtime, the way an MLServer user
would write one (MLServer ships no ONNX runtime): inputs decoded and outputs encoded with
MLServer's own NumpyCodec. Loaded by a real `mlserver start` (tests/support/mlserver_peer.py),
never imported by edge-batcher."""

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    async def load(self) -> bool:
        self.session = ort.InferenceSession(self.settings.parameters.uri, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feed = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        outputs = self.session.run(None, feed)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(name, value) for name, value in zip(self.output_names, outputs)],
        )
