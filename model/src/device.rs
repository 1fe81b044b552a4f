//! Where a model runs and in what precision: `device: cpu | cuda | cuda:N` and
//! `dtype: f32 | bf16`, as every configuration that runs a model writes them.
//!
//! CUDA needs a build with the `cuda` cargo feature and a machine with the NVIDIA driver;
//! asking for it otherwise is one clear error (never cudarc's panic when `libcuda.so` is
//! absent: its presence is checked first).
//!
//! ```
//! use streamrl_model::device::{DeviceSpec, Precision};
//!
//! let d: DeviceSpec = "cuda:1".parse().unwrap();
//! assert_eq!(d, DeviceSpec::Cuda(1));
//! assert_eq!(d.to_string(), "cuda:1");
//! assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
//! assert!("gpu".parse::<DeviceSpec>().unwrap_err().contains("`gpu`"));
//! assert_eq!("bf16".parse::<Precision>().unwrap().dtype(), candle_core::DType::BF16);
//! ```

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};

use crate::{Error, Result};

/// A device a model runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DeviceSpec {
    /// The host CPU (the default; the fused CPU kernels run here).
    #[default]
    Cpu,
    /// CUDA device number N (`cuda` alone is `cuda:0`).
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let bad = || format!("device `{s}`: expected `cpu`, `cuda` or `cuda:N` (N a device number)");
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            t => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl serde::Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl DeviceSpec {
    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// Opens the device. CUDA fails with an error that says why: a build without the
    /// `cuda` feature, no NVIDIA driver on this machine, or no device with that number.
    pub fn open(&self) -> Result<Device> {
        match *self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => open_cuda(n),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(n: usize) -> Result<Device> {
    if !cuda_driver_present() {
        return Err(Error::Device(format!(
            "device `cuda:{n}`: no NVIDIA driver on this machine (libcuda.so.1 not found by the \
             dynamic loader); use `device: cpu`"
        )));
    }
    Device::new_cuda(n).map_err(|e| Error::Device(format!("device `cuda:{n}`: {e}")))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(n: usize) -> Result<Device> {
    Err(Error::Device(format!(
        "device `cuda:{n}`: this streamrl was built without CUDA; rebuild it with \
         `cargo build --release --features cuda` (README, \"GPU\") or use `device: cpu`"
    )))
}

/// Whether the NVIDIA driver library can be loaded (always false in a build without the
/// `cuda` feature). Checked before any CUDA call: cudarc panics when it is missing.
#[allow(unsafe_code)]
pub fn cuda_driver_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only tries to dlopen the driver library and reports whether it loaded.
        unsafe { candle_core::cuda_backend::cudarc::driver::sys::is_culib_present() }
    }
    #[cfg(not(feature = "cuda"))]
    false
}

/// The number type a model computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit floats (the default).
    #[default]
    F32,
    /// bfloat16 matrix products with f32 sums; logits, losses and optimizer state stay
    /// f32. On the CPU the weights stay f32 too (the master copy the optimizer updates)
    /// and every matrix product rounds its inputs to bf16 and runs on the CPU's matrix
    /// units (`streamrl_kernels::bf16`: AMX, or AVX-512 BF16, else f32); on a GPU the
    /// weights and activations are bf16 tensors and the optimizer keeps f32 master weights.
    Bf16,
}

impl Precision {
    /// The candle dtype of the weights on a GPU (and of bf16 tensors anywhere).
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// The dtype weights are held in on `device`: f32 on the CPU whatever the precision
    /// (bf16 there is in the products), [`Precision::dtype`] elsewhere.
    pub fn weights(self, device: &Device) -> DType {
        if device.is_cpu() { DType::F32 } else { self.dtype() }
    }

    /// The number type of the CPU's matrix products (f32 on other devices, which compute
    /// in their weights' dtype).
    pub fn products(self, device: &Device) -> streamrl_kernels::bf16::Products {
        use streamrl_kernels::bf16::Products;
        match self {
            Precision::Bf16 if device.is_cpu() => Products::Bf16,
            _ => Products::F32,
        }
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            other => Err(format!("dtype `{other}`: expected `f32` or `bf16`")),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Precision {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for s in ["cpu", "cuda:0", "cuda:3"] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap().to_string(), s);
        }
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(0));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        let e = "fp16".parse::<Precision>().unwrap_err();
        assert!(e.contains("`fp16`") && e.contains("bf16"), "{e}");
        let d: DeviceSpec = serde_yaml::from_str("cuda:2").unwrap();
        assert_eq!(d, DeviceSpec::Cuda(2));
        let e = serde_yaml::from_str::<DeviceSpec>("tpu").unwrap_err().to_string();
        assert!(e.contains("`tpu`"), "{e}");
        let p: Precision = serde_yaml::from_str("bf16").unwrap();
        assert_eq!(p, Precision::Bf16);
    }

    /// Asking for CUDA where there is none is an error that says why, not a panic. (On a
    /// machine with a GPU and a `cuda` build, it opens.)
    #[test]
    fn cuda_without_a_gpu_is_a_clear_error() {
        match DeviceSpec::Cuda(0).open() {
            Ok(d) => {
                assert!(cfg!(feature = "cuda") && cuda_driver_present());
                assert!(d.is_cuda());
                eprintln!("a CUDA device was found: the error path was not exercised");
            }
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with("device `cuda:0`: "), "{e}");
                if !cfg!(feature = "cuda") {
                    assert!(e.contains("--features cuda"), "{e}");
                } else if !cuda_driver_present() {
                    assert!(e.contains("no NVIDIA driver"), "{e}");
                }
            }
        }
        // A device number that cannot exist is refused on every machine.
        assert!(DeviceSpec::Cuda(4096).open().is_err());
    }
}
