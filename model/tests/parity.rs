//! The fused RL kernels against their references: on the CPU always, and on the first
//! CUDA device when this is a `cuda` build on a machine with one (otherwise the test says
//! plainly that no CUDA device was found and checks only the CPU).

#[path = "../../tests/common/skip.rs"]
mod skip;

use candle_core::Device;
use streamrl_model::device::{DeviceSpec, cuda_driver_present};
use streamrl_model::parity;

fn check(device: &Device, name: &str) {
    let checks = parity::run(device).unwrap();
    assert!(checks.len() >= 8, "{name}: {} checks", checks.len());
    for c in &checks {
        eprintln!(
            "{name:<5} {:<34} {:<40} value {:.1e} grad {:.1e} (≤ {:.0e})",
            c.kernel, c.case, c.value_err, c.grad_err, c.tol
        );
    }
    let bad: Vec<_> = checks.iter().filter(|c| !c.ok()).collect();
    assert!(bad.is_empty(), "{name}: {bad:#?}");
}

#[test]
fn fused_kernels_match_their_references_on_the_cpu() {
    check(&Device::Cpu, "cpu");
}

#[test]
fn cuda_kernels_match_their_references_when_a_gpu_is_present() {
    match DeviceSpec::Cuda(0).open() {
        Ok(d) => check(&d, "cuda"),
        Err(e) => {
            // Not a silent pass: the reason is printed, and it is one of the two expected.
            skip::skipped(
                "cuda_kernels_match_their_references_when_a_gpu_is_present",
                "the CUDA parity checks",
                &format!("no CUDA device: {e}"),
            );
            let e = e.to_string();
            assert!(e.starts_with("device `cuda:0`: "), "{e}");
            if !cfg!(feature = "cuda") {
                assert!(e.contains("built without CUDA"), "{e}");
            } else if !cuda_driver_present() {
                assert!(e.contains("no NVIDIA driver"), "{e}");
            }
        }
    }
}
