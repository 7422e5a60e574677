//! Models built from [`crate::ops`] layers.

pub mod bert;
