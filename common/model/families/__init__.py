"""One module per model family: how its config.json reads and which layers its decoder
stacks (common/model/registry.py names them; docs/structure.md, "Adding a model family")."""
