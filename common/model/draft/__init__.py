"""Draft models for speculative decoding: DSpark (dspark.py, its V4 form dspark_v4.py) and
DeepSeek's MTP layers (mtp.py, mtp_layer.py)."""
