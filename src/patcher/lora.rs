//! LoRA files.
