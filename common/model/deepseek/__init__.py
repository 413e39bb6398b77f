"""DeepSeek's sparse-attention models: V3.2's lightning indexer + sparse MLA (dsa.py) and
V4's layers, attention, config and TP cut (dsv4*.py)."""
