"""Retrieval-augmented generation on the device (docs/rag.md).

    tokenize.py   text <-> token ids with the `tokenizers` library (a local tokenizer.json)
    embed.py      TextEmbeddingEngine: text in, L2-normalised embeddings out, batched by the core scheduler
    index.py      passages split from .txt/.md files, their and their sentences' embeddings, BM25 statistics
    sentences.py  a passage's sentences, as the embedding model sees them
    lexical.py    BM25 over the passages (pure numpy)
    fusion.py     passage cosine, best sentence cosine and BM25 fused (normalised scores added, or RRF)
    extract.py    extractive answers: the best one or two sentences of the retrieved passages
    peer.py       ChatPeer: an OpenAI-compatible chat-completions server as the generator, streamed
    prompt.py     retrieved passages + question -> the generator's prompt
    kv.py         KV-cache arithmetic and the guaranteed-no-evict admission rule (pure)
    sampling.py   greedy / temperature / top-k / top-p choice of the next token (pure)
    decoder.py    an Optimum-layout ONNX decoder: prefill, batched decode steps, the batch's KV cache
    generate.py   GenerationService: a generator model's prompts checked, queued, answered or streamed
    decode_loop.py  DecodeLoop: iteration-level continuous batching and KV admission on a dedicated thread
    sequence.py   Sequence (one prompt being generated, its events) and GenerationResult
    pipeline.py   RagService: question -> embedding -> top-k -> prompt -> local / peer generator, or extractive
    settings.py   the rag model's [rag] / [rag.peer] settings, checked; where its index lives
    service.py    what both services share: text inputs, in-flight counter, stream -> response
    index_cli.py  `edge-batcher index add|list|info|remove`
"""
