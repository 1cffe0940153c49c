"""BERT's data: the pydoc corpus and WordPiece tokenizer, pre-training samples (MLM + NSP),
MLPerf shards (format, index, lazy source, writer) and the per-step batch builders. Submodules
are imported explicitly (several import torch)."""
