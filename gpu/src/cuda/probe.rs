//! Finding out whether CUDA can run here, before anything touches cudarc's driver bindings.
//!
//! With `dynamic-loading`, cudarc opens libcuda (and libnvrtc) the first time one of their
//! functions is called, and panics when the library is missing. So the CUDA backend asks first,
//! through cudarc's own presence checks (they try exactly the names its loader tries), and turns
//! each absence into an error that names what is missing and where it was looked for. Only after
//! the probe passes does any code call into the driver.
//!
//! cuBLAS is not probed: the backend does not call it (see `kernels`' module docs on why its
//! products are our own kernels).

use std::fmt;

use cudarc::driver::CudaContext;

/// What a working CUDA device looks like to the backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. `(9, 0)` for H100 and H200.
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
    /// Devices the driver sees.
    pub devices_present: usize,
}

/// Why CUDA cannot run here, each naming what is missing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProbeError {
    /// libcuda did not load under any of the names cudarc tries.
    NoDriver { tried: Vec<String> },
    /// libnvrtc (the run-time compiler of our kernels) did not load.
    NoNvrtc { tried: Vec<String> },
    /// The driver loaded but reported an error (no device at all, a driver too old, ...).
    Driver { call: &'static str, error: String },
    /// A device index past the last device.
    NoSuchDevice { requested: usize, present: usize },
}

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeError::NoDriver { tried } => write!(
                f,
                "no CUDA driver: libcuda.so.1 not found (tried {}; is the NVIDIA driver installed \
                 and its library on the loader path?)",
                tried.join(", ")
            ),
            ProbeError::NoNvrtc { tried } => write!(
                f,
                "no NVRTC: libnvrtc not found (tried {}; install the CUDA toolkit or the \
                 nvidia-cuda-nvrtc-cu12 wheel and put its lib directory on LD_LIBRARY_PATH)",
                tried.join(", ")
            ),
            ProbeError::Driver { call, error } => write!(f, "CUDA driver error in {call}: {error}"),
            ProbeError::NoSuchDevice { requested, present } => {
                let s = if *present == 1 { "" } else { "s" };
                write!(f, "CUDA device {requested} requested, {present} device{s} present")
            }
        }
    }
}

impl std::error::Error for ProbeError {}

/// The file names cudarc's loader tries for `library` ("cuda", "nvrtc").
fn candidates(library: &str) -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(library);
    // cudarc's list repeats some names (`libnvrtc.so.12` twice): each once, in its order.
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|name| seen.insert(name.clone()));
    names
}

/// Whether libcuda loads, trying cudarc's names.
#[allow(unsafe_code)]
pub fn driver_present() -> bool {
    // SAFETY: only opens and closes the library by name (libloading); no symbol of it is called.
    // Loading libcuda runs no initializer with preconditions of ours.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether libnvrtc loads, trying cudarc's names.
#[allow(unsafe_code)]
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`: the library is opened and closed, nothing in it called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC, or the error naming it: what compiling our kernels needs, with or without a device.
pub fn require_nvrtc() -> Result<(), ProbeError> {
    match nvrtc_present() {
        true => Ok(()),
        false => Err(ProbeError::NoNvrtc { tried: candidates("nvrtc") }),
    }
}

/// Checks, in order, the driver library, the device count, `ordinal`, and NVRTC; then reads the
/// device's name, compute capability and memory. Never panics, and calls into the driver only
/// after its library was found.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, ProbeError> {
    let info = probe_device(ordinal)?;
    require_nvrtc()?;
    Ok(info)
}

/// `probe` without NVRTC: for kernels compiled ahead of time (`CudaExecutor::with_prebuilt`).
pub fn probe_device(ordinal: usize) -> Result<DeviceInfo, ProbeError> {
    if !driver_present() {
        return Err(ProbeError::NoDriver { tried: candidates("cuda") });
    }
    let driver = |call: &'static str| {
        move |e: cudarc::driver::DriverError| ProbeError::Driver { call, error: e.to_string() }
    };
    let present = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    let present = usize::try_from(present).unwrap_or(0);
    if ordinal >= present {
        return Err(ProbeError::NoSuchDevice { requested: ordinal, present });
    }
    let context = CudaContext::new(ordinal).map_err(driver("cuDevicePrimaryCtxRetain"))?;
    Ok(DeviceInfo {
        ordinal,
        name: context.name().map_err(driver("cuDeviceGetName"))?,
        compute_capability: context.compute_capability().map_err(driver("cuDeviceGetAttribute"))?,
        memory_bytes: context.total_mem().map_err(driver("cuDeviceTotalMem"))?,
        devices_present: present,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_names_what_is_missing_and_never_panics() {
        match probe(0) {
            Err(ProbeError::NoDriver { tried }) => {
                assert!(!driver_present());
                assert!(tried.iter().any(|name| name == "libcuda.so.1"), "{tried:?}");
                let message = ProbeError::NoDriver { tried }.to_string();
                assert!(message.starts_with("no CUDA driver: libcuda.so.1 not found"), "{message}");
            }
            // A machine with a driver: either a device, or an error that says why not.
            Ok(info) => {
                assert!(info.devices_present >= 1 && info.compute_capability.0 >= 1);
                assert!(info.memory_bytes > 0, "{info:?}");
            }
            Err(e @ (ProbeError::NoNvrtc { .. } | ProbeError::Driver { .. })) => {
                assert!(driver_present(), "{e}");
            }
            Err(e @ ProbeError::NoSuchDevice { .. }) => panic!("device 0 exists if any: {e}"),
        }
    }

    #[test]
    fn a_device_past_the_last_is_refused_with_the_count() {
        match probe(1_000) {
            Err(ProbeError::NoDriver { .. }) => assert!(!driver_present()),
            Err(ProbeError::NoSuchDevice { requested, present }) => {
                assert_eq!(requested, 1_000);
                let message = ProbeError::NoSuchDevice { requested, present }.to_string();
                assert!(message.contains("device 1000 requested"), "{message}");
            }
            other => panic!("device 1000 should not exist: {other:?}"),
        }
        let one = ProbeError::NoSuchDevice { requested: 3, present: 1 };
        assert_eq!(one.to_string(), "CUDA device 3 requested, 1 device present");
    }

    #[test]
    fn missing_nvrtc_says_how_to_get_it() {
        let message = ProbeError::NoNvrtc { tried: candidates("nvrtc") }.to_string();
        assert!(message.contains("libnvrtc.so.12") && message.contains("LD_LIBRARY_PATH"));
    }
}
