"""Preprocessing: the logic behind the `data/` tools (raw web text -> clean corpus -> pickle, TFRecord,
Megatron mmap).

- `engine`: parallel, bounded-memory, order-preserving tokenization, and `ordered_map`, the worker
  pool every tool shares.
- `jsonl`: streaming loose-JSON reading with per-line errors (file:line), atomic writers.
- `clean`: ftfy, language, minimum length and Gopher-style quality rules (data/cleanup_dataset.py).
- `unicode_repair`: ftfy's fix_text, equal to it, skipping the fixers that cannot change a line.
- `langid`: language ID with the pinned lid.176.ftz (sha256-checked, never downloaded).
- `minhash`: shingles, MinHash signatures, LSH band keys, exact Jaccard.
- `dedup`: exact and near-duplicate removal over streamed fingerprints (.npz, never pickle).
- `openwebtext_dedup`: the seed's find_duplicates / group_duplicate_url / remove_group_duplicates.
- `decontaminate`: removing n-gram overlaps with evaluation sets (data/filter_ngrams.py).
- `splits`: loose JSON -> fixed train/dev/test files (data/split_json.py, Megatron's scripts/split_json.py).
- `urls`: the URL blacklist rules (data/blacklist_urls.py).
- `prepare`: the whole corpus path in one resumable command with a manifest (data/prepare_corpus.py).
- `stages`: its stages, each a file-to-file function with a record; `manifest`: the records, and
  which stages are complete.
- `sharded`: the same path as N independent shard tasks plus one merge, equal to one machine's.
- `megatron`: loose JSON -> `<prefix>_text_document.{bin,idx}` and merging (gpt2forge.data.indexed).
- `recipe`: what an indexed dataset was made from (input identity, tokenizer), kept beside it.
- `wikipedia`: WikiExtractor output -> `.pkl`; OpenWebText tarballs -> loose JSON.
- `tfrecord_writer`: pickle or mmap -> TFRecord shards + `.index` files.
- `bpe`: training a byte-level BPE tokenizer on any corpus.
- `describe`: a summary of any data file (data/inspect_data.py).

May import: gpt2forge.core, gpt2forge.text (tokenizers), gpt2forge.data (the formats it writes).
"""
