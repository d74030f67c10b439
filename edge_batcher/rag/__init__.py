"""Retrieval-augmented generation on the device (docs/rag.md).

    tokenize.py   text <-> token ids with the `tokenizers` library (a local tokenizer.json)
    embed.py      TextEmbeddingEngine: text in, L2-normalised embeddings out, batched by the core scheduler
    index.py      passages split from .txt/.md files, embeddings and BM25 statistics on disk, top-k
    lexical.py    BM25 over the passages (pure numpy)
    fusion.py     dense + lexical rankings fused by reciprocal rank fusion
    extract.py    extractive answers: the best one or two sentences of the retrieved passages
    peer.py       ChatPeer: an OpenAI-compatible chat-completions server as the generator, streamed
    prompt.py     retrieved passages + question -> the generator's prompt
    kv.py         KV-cache arithmetic and the guaranteed-no-evict admission rule (pure)
    sampling.py   greedy / temperature / top-k / top-p choice of the next token (pure)
    decoder.py    an Optimum-layout ONNX decoder: prefill, batched decode steps, the batch's KV cache
    generate.py   GenerationService: iteration-level continuous batching on a dedicated thread
    pipeline.py   RagService: question -> embedding -> top-k -> prompt -> local / peer generator, or extractive
    service.py    what both services share: text inputs, in-flight counter, stream -> response
    index_cli.py  `edge-batcher index add|list|info|remove`
"""
