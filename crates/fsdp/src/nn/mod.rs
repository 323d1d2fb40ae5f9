//! Layers and fused training kernels on candle.

pub mod ops;
