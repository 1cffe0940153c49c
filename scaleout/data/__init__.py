"""Generic data pieces: the per-step :class:`~scaleout.data.batches.MicroBatch` and the
rank-sharded sampler. Family-specific data (BERT's corpus, tokenizer, shards and packing;
ResNet's images) lives in the family's folder, scaleout/families/<name>/. The Wikipedia-512
length histogram (``wikipedia_seqlen_hist_512.txt``) ships here as package data."""
