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
    /// The memory's peak bandwidth in bytes a second, from the memory clock and bus width the
    /// driver reports (`peak_memory_bandwidth`); `None` where it reports neither (the
    /// emulator). What a decode step's roofline is measured against, so an H100 (3.35 TB/s)
    /// and an H200 (4.8 TB/s) are each judged by their own.
    pub memory_bytes_per_s: Option<u64>,
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
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    // Not an error when missing: only a benchmark's roofline reads it.
    let clock_khz = context.attribute(Attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).ok();
    let bus_bits = context.attribute(Attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).ok();
    Ok(DeviceInfo {
        ordinal,
        name: context.name().map_err(driver("cuDeviceGetName"))?,
        compute_capability: context.compute_capability().map_err(driver("cuDeviceGetAttribute"))?,
        memory_bytes: context.total_mem().map_err(driver("cuDeviceTotalMem"))?,
        memory_bytes_per_s: clock_khz.zip(bus_bits).and_then(|(c, b)| peak_memory_bandwidth(c, b)),
        devices_present: present,
    })
}

/// Peak memory bandwidth in bytes a second from the driver's memory clock (kHz) and bus width
/// (bits): two transfers a clock, as CUDA's own samples compute it (`deviceQuery`). `None` for a
/// zero or negative reading. It is the interface's peak: HBM's sustained copy rate is lower
/// (the H200 copied about 4.3 of its 4.8 TB/s), so a fraction of it never flatters a kernel.
pub fn peak_memory_bandwidth(clock_khz: i32, bus_bits: i32) -> Option<u64> {
    let clock_hz = u64::try_from(clock_khz).ok().filter(|&c| c > 0)? * 1000;
    let bus_bytes = u64::try_from(bus_bits).ok().filter(|&b| b > 0)? / 8;
    Some(2 * clock_hz * bus_bytes)
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
    fn peak_bandwidth_is_two_transfers_a_memory_clock() {
        // An H100 SXM's readings (deviceQuery: 2619 MHz, 5120-bit): its datasheet's 3.35 TB/s.
        assert_eq!(peak_memory_bandwidth(2_619_000, 5120), Some(3_352_320_000_000));
        assert_eq!(peak_memory_bandwidth(0, 5120), None);
        assert_eq!(peak_memory_bandwidth(2_619_000, 0), None);
        assert_eq!(peak_memory_bandwidth(-1, 5120), None);
    }

    #[test]
    fn missing_nvrtc_says_how_to_get_it() {
        let message = ProbeError::NoNvrtc { tried: candidates("nvrtc") }.to_string();
        assert!(message.contains("libnvrtc.so.12") && message.contains("LD_LIBRARY_PATH"));
    }
}
