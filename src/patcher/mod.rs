//! Patches on model weights: their kinds and math ([`patch`]) and reading LoRA files onto a
//! model's weight names ([`lora`]). Patches never modify base weights; they are applied to copies.

pub mod lora;
pub mod patch;
