//! Every CUDA kernel compiles with NVRTC, without error or warning, for each architecture the
//! backend targets: sm_90 (H100, H200), sm_100 (B200), sm_120 (RTX Blackwell). No GPU needed.
//!
//! NVRTC is a library found at run time (cudarc's dynamic loading): `ci/nvrtc-kernels.sh` puts
//! the PyPI wheel's on `LD_LIBRARY_PATH` and sets `LOCKSTEP_REQUIRE_NVRTC=1`. Without NVRTC the
//! test skips with the reason printed, unless that variable asks for it to fail. With
//! `LOCKSTEP_WRITE_CUBINS=DIR` the cubins are also written to DIR, for a device without NVRTC.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, reason = "test code: a panic is the failure report")]

use lockstep_gpu::cuda::kernels;
use lockstep_gpu::cuda::nvrtc::{self, Target};
use lockstep_gpu::cuda::probe;

const TARGETS: [u32; 3] = [90, 100, 120];

/// NVRTC is here, or the test should skip (`false`) or fail (panics) per the environment.
fn nvrtc_or_skip() -> bool {
    match probe::require_nvrtc() {
        Ok(()) => true,
        Err(missing) if std::env::var("LOCKSTEP_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("LOCKSTEP_REQUIRE_NVRTC=1 but {missing}")
        }
        Err(missing) => {
            eprintln!("skipped: {missing} (ci/nvrtc-kernels.sh provides it)");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_cleanly_for_hopper_and_blackwell() {
    if !nvrtc_or_skip() {
        return;
    }
    let version = nvrtc::version().expect("NVRTC reports its version");
    let supported = nvrtc::supported_archs().expect("NVRTC lists its architectures");
    eprintln!("NVRTC {}.{}, architectures {supported:?}", version.0, version.1);
    for sm in TARGETS {
        assert!(supported.contains(&sm), "NVRTC {version:?} cannot compile for sm_{sm}");
    }
    // An architecture a thread: NVRTC compiles distinct programs at once (its API is
    // thread-safe but for one program), and CI's two cores finish the three in two thirds of
    // the time one core takes.
    let failures: Vec<String> = std::thread::scope(|scope| {
        let each: Vec<_> = TARGETS.map(|sm| scope.spawn(move || compile_all(sm))).into();
        each.into_iter().flat_map(|thread| thread.join().unwrap()).collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// Every kernel compiled for `sm`, each cubin written where `LOCKSTEP_WRITE_CUBINS` asks; the
/// failures.
fn compile_all(sm: u32) -> Vec<String> {
    let mut failures = Vec::new();
    for kernel in kernels::ALL {
        match nvrtc::compile_clean(&kernel, Target::Cubin { sm }) {
            Ok(compiled) => {
                assert!(!compiled.image.is_empty(), "{}: an empty cubin", kernel.name);
                eprintln!("{}.cu sm_{sm}: {} bytes", kernel.name, compiled.image.len());
                // Kept for a device without NVRTC (`CudaExecutor::with_prebuilt`).
                if let Some(dir) = std::env::var_os("LOCKSTEP_WRITE_CUBINS") {
                    let path = std::path::Path::new(&dir).join(kernel.cubin_file(sm));
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::write(&path, &compiled.image).unwrap();
                }
            }
            Err(e) => failures.push(e),
        }
    }
    failures
}

#[test]
fn a_broken_kernel_fails_with_nvrtc_s_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = kernels::KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }",
        functions: &["broken"],
    };
    let err = nvrtc::compile(&broken, Target::Cubin { sm: 90 }).unwrap_err();
    assert!(err.contains("broken.cu") && err.contains("undefined_name"), "{err}");
    // A warning alone fails `compile_clean`, and `compile` keeps it in the log.
    let warns = kernels::KernelSource {
        name: "warns",
        source: "#warning \"planted\"\nextern \"C\" __global__ void warns(float* x) { x[0] = 1; }",
        functions: &["warns"],
    };
    let compiled = nvrtc::compile(&warns, Target::Cubin { sm: 90 }).expect("a warning compiles");
    assert!(compiled.log.contains("planted"), "{:?}", compiled.log);
    let err = nvrtc::compile_clean(&warns, Target::Cubin { sm: 90 }).unwrap_err();
    assert!(err.contains("warned") && err.contains("planted"), "{err}");
}

/// The PTX `choose_target` falls back to for an architecture NVRTC does not know (the driver
/// finishes it) compiles and holds every entry point. And a dependent launch is safe only if
/// every kernel waits for the one before it: on sm_90 each entry point's code holds
/// `griddepcontrol.wait` (the prelude's `wait_for_inputs`, which an architecture test could
/// compile out) and lets the next kernel start; the products prefetch their rows. Below sm_90
/// the instructions do not exist, the guard compiles them out, and the executor launches plainly
/// there. One test for both, so that CI compiles the sm_90 PTX once (20 s on one of its cores).
#[test]
fn ptx_for_a_newer_device_compiles_and_every_kernel_waits_for_the_one_before_it_on_hopper() {
    if !nvrtc_or_skip() {
        return;
    }
    for kernel in kernels::ALL {
        let ptx = |compute| {
            let compiled = nvrtc::compile_clean(&kernel, Target::Ptx { compute })
                .unwrap_or_else(|e| panic!("{e}"));
            String::from_utf8_lossy(&compiled.image).into_owned()
        };
        let hopper = ptx(90);
        for function in kernel.functions {
            assert!(hopper.contains(&format!(".entry {function}(")), "{function} in the PTX");
        }
        // Each entry point's body is the text from its `.entry` to the next one's.
        let entries: Vec<&str> = hopper.split(".entry ").skip(1).collect();
        assert_eq!(entries.len(), kernel.functions.len(), "{}: entry points", kernel.name);
        for body in entries {
            let name = body.split('(').next().unwrap_or_default();
            assert!(body.contains("griddepcontrol.wait"), "{name} never waits");
            assert!(body.contains("griddepcontrol.launch_dependents"), "{name} holds back");
            if kernel.name == "matmul" {
                assert!(body.contains("cp.async.bulk.prefetch.L2"), "{name} prefetches nothing");
            }
        }
        assert!(!ptx(80).contains("griddepcontrol"), "{}: PDL compiled for sm_80", kernel.name);
    }
}
