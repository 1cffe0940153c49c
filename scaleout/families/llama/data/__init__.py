"""The Llama family's data: Megatron-style indexed token files (``indexed.py``) and the rows the
trainer reads from them (``rows.py``)."""
