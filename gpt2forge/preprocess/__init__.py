"""Preprocessing: the logic behind the `data/` tools (corpus text -> pickle, TFRecord, Megatron mmap).

- `engine`: parallel, bounded-memory, order-preserving tokenization (every tool uses it).
- `megatron`: loose JSON -> `<prefix>_text_document.{bin,idx}` and merging (gpt2forge.data.indexed).
- `wikipedia`: WikiExtractor output -> `.pkl`; OpenWebText tarballs -> loose JSON.
- `tfrecords`: pickle or mmap -> TFRecord shards + `.index` files.
- `bpe`: training a byte-level BPE tokenizer on any corpus.
- `describe`: a summary of any data file (data/inspect_data.py).

May import: gpt2forge.core, gpt2forge.text (tokenizers), gpt2forge.data (the formats it writes).
"""
