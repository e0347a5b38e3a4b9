//! Continuous batching (coming next).
