//! Compiling the kernel sources with NVRTC for one architecture, with the compiler's log kept
//! (cudarc's `compile_ptx` drops it on success, and a warning is a failure to us), and choosing
//! the architecture for a device.
//!
//! A device whose architecture this NVRTC knows (sm_90 for H100/H200, sm_100 for B200, sm_120
//! for RTX Blackwell, ...) gets a cubin for exactly it. A device newer than this NVRTC gets PTX
//! for the newest virtual architecture NVRTC knows below it, which the driver compiles on load
//! (PTX runs on later architectures); an older one than NVRTC supports is refused.

use std::ffi::{CString, c_char, c_int};

use cudarc::nvrtc::{result, sys};

use super::kernels::KernelSource;

/// What to compile for: a real architecture (`sm_90`: a cubin) or a virtual one (`compute_90`:
/// PTX the driver finishes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Cubin { sm: u32 },
    Ptx { compute: u32 },
}

impl Target {
    /// The `--gpu-architecture` value.
    pub fn arch(self) -> String {
        match self {
            Target::Cubin { sm } => format!("sm_{sm}"),
            Target::Ptx { compute } => format!("compute_{compute}"),
        }
    }
}

/// The target for a device of compute capability `(major, minor)`, given the real
/// architectures (`90` for sm_90) this NVRTC supports.
pub fn choose_target(capability: (i32, i32), supported: &[u32]) -> Result<Target, String> {
    let (major, minor) = capability;
    let sm = u32::try_from(major * 10 + minor)
        .map_err(|_| format!("compute capability {major}.{minor} is not a real one"))?;
    if supported.contains(&sm) {
        return Ok(Target::Cubin { sm });
    }
    match supported.iter().copied().filter(|&s| s < sm).max() {
        Some(compute) => Ok(Target::Ptx { compute }),
        None => Err(format!(
            "compute capability {major}.{minor} is older than every architecture this NVRTC \
             supports ({supported:?})"
        )),
    }
}

/// A compiled module: what the driver loads, and the compiler's log.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub target: Target,
    /// A cubin, or NUL-terminated PTX text.
    pub image: Vec<u8>,
    /// Empty when NVRTC had nothing to say; otherwise warnings.
    pub log: String,
}

/// NVRTC's version, `(major, minor)`.
#[allow(unsafe_code)]
pub fn version() -> Result<(i32, i32), String> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two valid out-pointers; callers probed that libnvrtc loads (`probe::require_nvrtc`).
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion: {e:?}"))?;
    Ok((major, minor))
}

/// The real architectures this NVRTC compiles for, as `90` for sm_90.
#[allow(unsafe_code)]
pub fn supported_archs() -> Result<Vec<u32>, String> {
    let mut count: c_int = 0;
    // SAFETY: a valid out-pointer; then a buffer of exactly the count NVRTC reported.
    unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) }
        .result()
        .map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
    let mut archs: Vec<c_int> = vec![0; usize::try_from(count).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: `archs` holds `count` elements, as NVRTC writes.
        unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
    }
    Ok(archs.into_iter().filter_map(|a| u32::try_from(a).ok()).collect())
}

/// A C character as its byte: `c_char` is `i8` on x86-64 and `u8` on aarch64 (Grace Hopper
/// and Grace Blackwell hosts), where the cast does nothing.
#[allow(clippy::unnecessary_cast, reason = "a no-op where c_char is u8")]
fn byte(c: c_char) -> u8 {
    c as u8
}

/// NVRTC's bytes (log, cubin, PTX) as text, without the trailing NUL.
fn text(bytes: &[c_char]) -> String {
    let bytes: Vec<u8> = bytes.iter().map(|&b| byte(b)).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// What NVRTC is told when compiling for `target` (also part of a cached image's name,
/// `kernel_cache`).
pub fn options(target: Target) -> [String; 5] {
    [
        format!("--gpu-architecture={}", target.arch()),
        "--std=c++17".to_string(),
        // Precise division, square roots and denormals: the CPU backend's arithmetic.
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ]
}

/// Compiles `kernel` (prelude included) for `target`. An NVRTC error comes back with its log;
/// a success carries the log, which holds any warnings. Callers probed NVRTC first.
#[allow(unsafe_code)]
pub fn compile(kernel: &KernelSource, target: Target) -> Result<Compiled, String> {
    let source = CString::new(kernel.program())
        .map_err(|_| format!("{}.cu holds a NUL byte", kernel.name))?;
    let name = CString::new(format!("{}.cu", kernel.name))
        .map_err(|_| format!("{}: a NUL byte in the name", kernel.name))?;
    let program = result::create_program(&source, Some(&name))
        .map_err(|e| format!("{}.cu: nvrtcCreateProgram: {e:?}", kernel.name))?;
    let options = options(target);
    // SAFETY: `program` was created above and is destroyed once, below; `source` and `name`
    // outlive it.
    let compiled = unsafe { result::compile_program(program, &options) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program) }.map(|l| text(&l)).unwrap_or_default();
    let image = match compiled {
        Err(e) => Err(format!("{}.cu for {}: {e:?}\n{log}", kernel.name, target.arch())),
        // SAFETY: as above.
        Ok(()) => unsafe { image(program, target) }
            .map_err(|e| format!("{}.cu for {}: {e}", kernel.name, target.arch())),
    };
    // SAFETY: as above; nothing uses `program` after this.
    let destroyed = unsafe { result::destroy_program(program) };
    let image = image?;
    destroyed.map_err(|e| format!("{}.cu: nvrtcDestroyProgram: {e:?}", kernel.name))?;
    Ok(Compiled { target, image, log })
}

/// The compiled program's cubin or PTX.
///
/// # Safety
/// `program` is a live NVRTC program that compiled successfully.
#[allow(unsafe_code)]
unsafe fn image(program: sys::nvrtcProgram, target: Target) -> Result<Vec<u8>, String> {
    match target {
        Target::Ptx { .. } => {
            // SAFETY: the caller's contract.
            let ptx = unsafe { result::get_ptx(program) }.map_err(|e| format!("{e:?}"))?;
            Ok(ptx.into_iter().map(byte).collect())
        }
        Target::Cubin { .. } => {
            let mut size = 0usize;
            // SAFETY: the caller's contract; a valid out-pointer.
            unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut cubin: Vec<c_char> = vec![0; size];
            // SAFETY: `cubin` holds the `size` bytes NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            Ok(cubin.into_iter().map(byte).collect())
        }
    }
}

/// `compile`, refusing a success whose log is not empty: a warning is a failure to us.
pub fn compile_clean(kernel: &KernelSource, target: Target) -> Result<Compiled, String> {
    let compiled = compile(kernel, target)?;
    match compiled.log.is_empty() {
        true => Ok(compiled),
        false => Err(format!(
            "{}.cu for {}: NVRTC warned:\n{}",
            kernel.name,
            target.arch(),
            compiled.log
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_architecture_gets_a_cubin_and_a_newer_one_ptx_below_it() {
        let supported = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(choose_target((9, 0), &supported), Ok(Target::Cubin { sm: 90 }));
        assert_eq!(choose_target((12, 0), &supported), Ok(Target::Cubin { sm: 120 }));
        assert_eq!(choose_target((10, 3), &supported), Ok(Target::Ptx { compute: 100 }));
        assert_eq!(choose_target((13, 0), &supported), Ok(Target::Ptx { compute: 120 }));
        assert!(choose_target((6, 1), &supported).unwrap_err().contains("older"));
        assert_eq!(Target::Cubin { sm: 90 }.arch(), "sm_90");
        assert_eq!(Target::Ptx { compute: 100 }.arch(), "compute_100");
    }
}
