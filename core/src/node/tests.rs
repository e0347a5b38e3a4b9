//! tests placeholder
