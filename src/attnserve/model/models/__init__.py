"""Model implementations on attnserve's layers (see attnserve.model.registry), and `hf_export`:
the same weights as an HF transformers model."""
