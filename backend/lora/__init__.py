"""LoRA adapters served beside the base model in mixed batches (docs/architecture.md, "LoRA adapters")."""
