//! What the model tests share: the bundled default model, or a skip with the reason when it has
//! not been fetched. CI fetches it and sets LOCKSTEP_REQUIRE_MODEL, so there a test cannot pass
//! by skipping.

#![allow(dead_code, reason = "each test file uses what it needs")]

use lockstep_gpu::gguf::Gguf;

/// The default model's path and bytes, if `LOCKSTEP_DEFAULT_MODEL` names it.
pub fn default_model() -> Option<(String, Vec<u8>)> {
    let Ok(path) = std::env::var("LOCKSTEP_DEFAULT_MODEL") else {
        assert!(
            std::env::var_os("LOCKSTEP_REQUIRE_MODEL").is_none(),
            "LOCKSTEP_DEFAULT_MODEL is required"
        );
        eprintln!("skipped: set LOCKSTEP_DEFAULT_MODEL (ci/fetch-default-model.sh prints it)");
        return None;
    };
    let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    Some((path, file))
}

pub fn parse(file: &[u8]) -> Gguf {
    Gguf::parse(file).unwrap_or_else(|e| panic!("{e}"))
}
