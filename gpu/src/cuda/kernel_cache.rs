//! Compiled kernel modules kept on disk between runs, so that a server's restart does not wait
//! for NVRTC again: the product module alone takes NVRTC about 22 s for sm_90 on one core, the
//! whole set about 25 s, at every start (`ci/nvrtc-kernels.sh` prints the times).
//!
//! An entry is named by everything that decides its bytes: the source with its prelude, the
//! NVRTC options, the target and NVRTC's version, hashed (FNV-1a, 64 bits: a name, not a
//! defence; the folder is the user's own). So a changed kernel, a new NVRTC or another GPU
//! never meets an old image; nothing expires. Entries are written to a temporary file and
//! renamed, so a reader sees a whole image or none, and two servers starting at once both
//! write the same bytes. An image the driver refuses anyway (a damaged file) is deleted and
//! compiled again by the caller (`launch::Kernels::load`). A cache that cannot be read or
//! written costs the compile, never the start: the caller logs it and goes on.

use std::path::{Path, PathBuf};

use super::kernels::KernelSource;
use super::nvrtc::{self, Target};

/// A folder of compiled kernel images.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    pub fn at(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// `LOCKSTEP_KERNEL_CACHE` if set (empty: no cache), else `$XDG_CACHE_HOME/lockstep/kernels`,
    /// else `$HOME/.cache/lockstep/kernels`; none without a home.
    pub fn from_env() -> Option<KernelCache> {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(dir) = std::env::var_os("LOCKSTEP_KERNEL_CACHE") {
            return (!dir.is_empty()).then(|| KernelCache::at(dir));
        }
        let base = var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|home| Path::new(&home).join(".cache")))?;
        Some(KernelCache::at(base.join("lockstep").join("kernels")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file `source`'s image for `target` from NVRTC `version` is kept in.
    pub fn path(&self, source: &KernelSource, target: Target, version: (i32, i32)) -> PathBuf {
        let mut key = Fnv1a::new();
        key.write(source.program().as_bytes());
        for option in nvrtc::options(target) {
            key.write(b"\0");
            key.write(option.as_bytes());
        }
        key.write(format!("\0nvrtc {}.{}", version.0, version.1).as_bytes());
        let extension = match target {
            Target::Cubin { .. } => "cubin",
            Target::Ptx { .. } => "ptx",
        };
        self.dir.join(format!("{}.{}.{:016x}.{extension}", source.name, target.arch(), key.0))
    }

    /// The kept image at `path`, if there is one.
    pub fn get(&self, path: &Path) -> Option<Vec<u8>> {
        std::fs::read(path).ok().filter(|image| !image.is_empty())
    }

    /// Keeps `image` at `path`: written beside it under a name of this process's, then renamed.
    pub fn put(&self, path: &Path, image: &[u8]) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| format!("kernel cache {}: {e}", self.dir.display()))?;
        let temporary = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&temporary, image).and_then(|()| std::fs::rename(&temporary, path)).map_err(
            |e| {
                let _ = std::fs::remove_file(&temporary);
                format!("kernel cache {}: {e}", path.display())
            },
        )
    }

    /// Deletes the image at `path` (the driver refused it).
    pub fn forget(&self, path: &Path) {
        let _ = std::fs::remove_file(path);
    }
}

/// FNV-1a over bytes: stable across runs, platforms and Rust versions (std's hasher is not
/// promised to be).
struct Fnv1a(u64);

impl Fnv1a {
    fn new() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::kernels;

    #[test]
    fn an_entry_is_named_by_source_target_and_nvrtc() {
        let cache = KernelCache::at("/cache");
        let sm90 = Target::Cubin { sm: 90 };
        let path = cache.path(&kernels::MATMUL, sm90, (12, 8));
        let name = path.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("matmul.sm_90.") && name.ends_with(".cubin"), "{name}");
        assert_eq!(path, cache.path(&kernels::MATMUL, sm90, (12, 8)), "the same every time");
        let others = [
            cache.path(&kernels::EMBED, sm90, (12, 8)),
            cache.path(&kernels::MATMUL, Target::Cubin { sm: 100 }, (12, 8)),
            cache.path(&kernels::MATMUL, Target::Ptx { compute: 90 }, (12, 8)),
            cache.path(&kernels::MATMUL, sm90, (12, 9)),
        ];
        for other in others {
            assert_ne!(path, other);
        }
        // A changed source is another entry.
        let edited = KernelSource { source: "// edited\n", ..kernels::MATMUL };
        assert_ne!(path, cache.path(&edited, sm90, (12, 8)));
    }

    #[test]
    fn an_image_is_kept_whole_and_forgotten() {
        let dir =
            std::env::temp_dir().join(format!("lockstep-kernel-cache-{}", std::process::id()));
        let cache = KernelCache::at(dir.join("nested"));
        let path = cache.path(&kernels::ARGMAX, Target::Cubin { sm: 90 }, (12, 8));
        assert_eq!(cache.get(&path), None);
        cache.put(&path, b"image bytes").unwrap();
        assert_eq!(cache.get(&path).as_deref(), Some(&b"image bytes"[..]));
        // Nothing else is left in the folder: the temporary file was renamed.
        assert_eq!(std::fs::read_dir(cache.dir()).unwrap().count(), 1);
        cache.forget(&path);
        assert_eq!(cache.get(&path), None);
        // An empty file (a full disk at the wrong moment) is no entry.
        std::fs::write(&path, b"").unwrap();
        assert_eq!(cache.get(&path), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_folder_comes_from_the_environment() {
        // Read, not set: tests share the process's environment.
        match std::env::var_os("LOCKSTEP_KERNEL_CACHE") {
            Some(dir) if dir.is_empty() => assert_eq!(KernelCache::from_env(), None),
            Some(dir) => assert_eq!(KernelCache::from_env(), Some(KernelCache::at(dir))),
            None => {
                if let Some(cache) = KernelCache::from_env() {
                    assert!(cache.dir().ends_with("lockstep/kernels"), "{:?}", cache.dir());
                }
            }
        }
    }
}
