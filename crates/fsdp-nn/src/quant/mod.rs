//! Quantized weights for QLoRA: a frozen base weight kept as blocks of a quantized format
//! (llama.cpp's GGML block types, as GGUF files store them, or bitsandbytes' NF4), row by row,
//! and dequantized only where a product uses it.
//!
//! A quantized weight `[rows, cols]` is held as a parameter `[rows, words]` of 32-bit words:
//! each row's blocks, padded to whole words ([`Packing::row_words`]). The engine shards,
//! gathers, releases and checkpoints those words bit for bit like any parameter's elements
//! (an all-gather moves the quantized bytes, ~1/7 of f32's for 4-bit formats); only the
//! quantized ops read them, as bytes. They are never values: no optimizer, cast or gradient
//! touches them (a quantized weight is frozen, and mixed precision is refused with one).

pub(crate) mod format;

pub use format::{Packing, QuantError, QuantFormat};

// Turning a model's linear layers quantized is `layers::quantize_linears`: this module knows
// formats, not layers, so the two never import each other.
