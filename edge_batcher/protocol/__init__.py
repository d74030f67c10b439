"""Wire protocols: codecs between numpy tensors and request/response bodies."""
