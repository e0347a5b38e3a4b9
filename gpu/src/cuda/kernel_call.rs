//! One kernel launch through `cuLaunchKernelEx`, so that it can carry programmatic dependent
//! launch (PDL, sm_90 on): a kernel so launched may start while the kernel before it in the
//! stream is still running, up to its `griddepcontrol.wait` (prelude.cu's `wait_for_inputs`).
//! What it does before that reads only the weights (the products prefetch their rows into L2),
//! so a decode step's 130-odd launches overlap their launch latency and their first weight reads
//! with the kernel before. Stream capture records the same programmatic edges into a graph.
//!
//! cudarc's launch builder has no launch attributes, hence this builder of our own: every
//! argument is a device pointer, an `int` or a `float`, each kept in an 8-byte slot that the
//! driver reads the parameter's size from (little-endian, so a 4-byte value is its slot's first
//! bytes). The executor's context does not track events (graph capture records none), so a
//! device pointer is taken without the stream waiting on anything.
#![allow(unsafe_code)]

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUlaunchAttribute, CUlaunchAttributeID, CUlaunchAttributeValue, CUlaunchConfig,
};
use cudarc::driver::{CudaFunction, CudaStream, DevicePtr, DriverError, LaunchConfig};

/// A 4-byte parameter's slot: its bytes first, as the driver reads them from the slot's address.
fn slot(bytes: [u8; 4]) -> u64 {
    let mut wide = [0; 8];
    wide[..4].copy_from_slice(&bytes);
    u64::from_ne_bytes(wide)
}

/// A kernel's arguments in order, built for one launch.
#[derive(Debug)]
pub struct KernelCall<'a> {
    stream: &'a CudaStream,
    function: &'a CudaFunction,
    slots: Vec<u64>,
}

impl<'a> KernelCall<'a> {
    pub fn new(stream: &'a CudaStream, function: &'a CudaFunction) -> KernelCall<'a> {
        KernelCall { stream, function, slots: Vec::with_capacity(16) }
    }

    /// A buffer (`CudaSlice` or `CudaView`) as a `T*` parameter.
    pub fn buffer<T>(&mut self, buffer: &impl DevicePtr<T>) -> &mut Self {
        let (pointer, _no_event) = buffer.device_ptr(self.stream);
        self.slots.push(pointer);
        self
    }

    /// A null pointer parameter (an optional input the kernel checks for).
    pub fn null(&mut self) -> &mut Self {
        self.slots.push(0);
        self
    }

    pub fn int(&mut self, value: i32) -> &mut Self {
        self.slots.push(slot(value.to_ne_bytes()));
        self
    }

    pub fn float(&mut self, value: f32) -> &mut Self {
        self.slots.push(slot(value.to_ne_bytes()));
        self
    }

    /// The parameters as the driver takes them: one pointer to each value.
    fn parameters(&mut self) -> Vec<*mut c_void> {
        self.slots.iter_mut().map(|slot| slot as *mut u64 as *mut c_void).collect()
    }

    /// Queues the kernel on the stream; with `dependent`, as a programmatic dependent launch of
    /// the kernel queued before it.
    ///
    /// # Safety
    /// The arguments match the kernel's parameters one for one, in order and type, and every
    /// buffer holds what the launch touches. A `dependent` launch's kernel reads nothing an
    /// earlier kernel writes, and writes nothing, before `wait_for_inputs()`; the operation
    /// queued before it is a kernel (after a copy the attribute is not what orders them).
    pub unsafe fn launch(
        &mut self,
        config: LaunchConfig,
        dependent: bool,
    ) -> Result<(), DriverError> {
        let mut parameters = self.parameters();
        // SAFETY: all-zero is a valid value of this plain C union; the field set next is the
        // one the attribute's id reads.
        let mut value: CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let (grid, block) = (config.grid_dim, config.block_dim);
        let launch = CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if dependent { &mut attribute } else { std::ptr::null_mut() },
            numAttrs: u32::from(dependent),
        };
        // SAFETY: the caller's contract; `parameters` points into `self.slots`, alive and
        // unmoved until the call returns, and the driver copies the values before returning.
        unsafe {
            sys::cuLaunchKernelEx(
                &launch,
                self.function.cu_function(),
                parameters.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_four_byte_value_is_the_first_bytes_of_its_slot() {
        for value in [0, 1, -3, i32::MAX, i32::MIN] {
            assert_eq!(slot(value.to_ne_bytes()).to_ne_bytes()[..4], value.to_ne_bytes());
        }
        assert_eq!(slot(1.5f32.to_ne_bytes()).to_ne_bytes()[..4], 1.5f32.to_ne_bytes());
    }
}
