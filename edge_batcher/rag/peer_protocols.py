"""The two streaming APIs a generation peer can speak (`[rag.peer] kind`), as request bodies and
event readers for rag/peer.py, which owns the connection, timeouts, health and breaker.

* `openai` (the default): `POST /v1/chat/completions` with `"stream": true` (vLLM, llama.cpp's
  server, Ollama, TensorRT-LLM / Edge-LLM servers). The prompt is one user message; events carry
  `choices[0].delta.content`, then `usage`, then `[DONE]`.
* `triton`: Triton's generate extension, `POST /v2/models/{model}/generate_stream` (Triton with
  the TensorRT-LLM or vLLM backend, or another edge-batcher). The body is `{"text_input":
  prompt, "stream": true, ...}` with the sampling parameters as top-level keys, as the extension
  maps them to the model's inputs; their names differ between servers, hence `parameter_names`
  (edge-batcher: max_new_tokens / temperature / top_p / seed; TensorRT-LLM's ensemble:
  max_tokens / temperature / top_p / random_seed). Events carry the piece in `text_output`; an
  edge-batcher peer marks the last one `"final": true` with finish_reason and token counts, a
  Triton server ends the stream; `{"error": ...}` is a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("openai", "triton")
CHAT_PATH = "/v1/chat/completions"
# max_new_tokens / temperature / top_p / seed -> the key a Triton-style peer reads (TensorRT-LLM's ensemble)
TRITON_PARAMETER_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                          "seed": "random_seed"}


@dataclass
class Update:
    """What one event of the peer's stream says."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens when the peer says
    error: str | None = None


class OpenAIChat:
    kind = "openai"
    health_path = "/v1/models"

    def path(self, model: str) -> str:
        return CHAT_PATH

    def body(self, model: str, prompt: str, generation: dict, parameter_names: dict[str, str]) -> dict:
        body: dict = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                      "stream_options": {"include_usage": True}}
        if "max_new_tokens" in generation:
            body["max_tokens"] = generation["max_new_tokens"]
        for key in ("temperature", "top_p", "seed"):
            if key in generation:
                body[key] = generation[key]
        return body

    def read(self, event: dict) -> Update:
        if "error" in event:
            return Update(error=str(event["error"]))
        update = Update(usage=event.get("usage") or {})
        for choice in event.get("choices") or ():
            update.text += (choice.get("delta") or {}).get("content") or ""
            update.finish_reason = choice.get("finish_reason") or update.finish_reason
        return update


class TritonGenerate:
    kind = "triton"
    health_path = "/v2/models/{model}/ready"

    def path(self, model: str) -> str:
        return f"/v2/models/{model}/generate_stream"

    def body(self, model: str, prompt: str, generation: dict, parameter_names: dict[str, str]) -> dict:
        body: dict = {"text_input": prompt, "stream": True}
        for ours, theirs in parameter_names.items():
            if ours in generation and theirs:
                body[theirs] = generation[ours]
        return body

    def read(self, event: dict) -> Update:
        if "error" in event:
            return Update(error=str(event["error"]))
        text = event.get("text_output")
        usage = {k: event[k] for k in ("prompt_tokens", "completion_tokens") if isinstance(event.get(k), int)}
        return Update(text=text if isinstance(text, str) else "", finish_reason=event.get("finish_reason"),
                      usage=usage)


def protocol(kind: str) -> OpenAIChat | TritonGenerate:
    return TritonGenerate() if kind == "triton" else OpenAIChat()
