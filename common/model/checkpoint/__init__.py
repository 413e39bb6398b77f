"""What a checkpoint directory holds and how it is read: finding the model (files.py),
config.json (config.py, its MoE part in moe_config.py) and the tokenizer (tokenizer.py)."""
