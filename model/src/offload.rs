//! Activation offloading: the tensors a training forward saves for its backward leave the
//! device while the rest of the forward runs, and come back one layer ahead of the
//! backward that needs them.
//!
//! On CUDA a layer's saved activations are copied to pinned host memory on a second
//! stream as soon as its forward has been issued (the copies overlap the next layers'
//! compute), their device memory is released one layer later (so the release never
//! stalls compute on a copy still running), and during the backward layer `i - 1` is
//! copied back while layer `i` is differentiated. Pinned buffers are pooled by size, so a
//! training step at a shape seen before allocates no host memory.
//!
//! On the CPU the same bookkeeping runs without copying: a stashed tensor's storage is
//! taken out and put back. Nothing is saved there (the activations are in host memory
//! already); it is how the tests check that every tensor a backward reads was brought back.
//!
//! Which tensors move: those that one layer's forward created and that nothing outside
//! that layer's autograd graph holds (found by counting a storage's holders against the
//! graph nodes that hold it). Weights, the layer's input and output, and tensors shared
//! across layers (rotary tables, masks) stay where they are.

use std::collections::HashMap;

use candle_core::{Device, Tensor};

use crate::Result;

/// What an offloading pass moved: bytes that left the device, and tensors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Bytes copied off the device (and back) in the pass.
    pub bytes: u64,
    /// Tensors (distinct storages) moved.
    pub tensors: usize,
}

/// One stashed storage: a tensor holding it (to put it back through) and where it is.
struct Stashed {
    tensor: Tensor,
    place: Place,
}

enum Place {
    /// CPU: the storage itself, taken out of the tensor.
    Held(candle_core::Storage),
    #[cfg(feature = "cuda")]
    /// CUDA: the bytes in a pinned buffer, and what to rebuild the device storage as.
    Pinned(cuda::Pinned),
}

/// Moves layers' saved activations off the device and back. One per training pass.
pub(crate) struct Offloader {
    layers: HashMap<usize, Vec<Stashed>>,
    stats: OffloadStats,
    #[cfg(feature = "cuda")]
    cuda: Option<cuda::Streams>,
}

impl Offloader {
    /// An offloader for a pass on `device`.
    pub(crate) fn new(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let cuda = match device {
            Device::Cuda(d) => Some(cuda::Streams::new(d)?),
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(Offloader {
            layers: HashMap::new(),
            stats: OffloadStats::default(),
            #[cfg(feature = "cuda")]
            cuda,
        })
    }

    /// What this pass moved so far.
    pub(crate) fn stats(&self) -> OffloadStats {
        self.stats
    }

    /// Moves off the device every storage that only the graph of `roots` holds (see the
    /// module docs), as layer `layer`'s.
    pub(crate) fn stash_graph(&mut self, layer: usize, roots: &[&Tensor]) -> Result<()> {
        let owned = layer_owned(roots);
        self.stash(layer, owned)
    }

    /// Moves `tensors` off the device as layer `layer`'s, each whose storage it alone holds.
    pub(crate) fn stash_tensors(&mut self, layer: usize, tensors: &[&Tensor]) -> Result<()> {
        let alone = tensors
            .iter()
            .filter(|t| t.storage_holders() == 1)
            .map(|t| (*t).clone())
            .collect();
        self.stash(layer, alone)
    }

    fn stash(&mut self, layer: usize, tensors: Vec<Tensor>) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(c) = self.cuda.as_mut() {
            c.after_compute()?;
        }
        let mut out = Vec::with_capacity(tensors.len());
        for tensor in tensors {
            let bytes = (tensor.elem_count() * tensor.dtype().size_in_bytes()) as u64;
            let place = match tensor.device() {
                #[cfg(feature = "cuda")]
                Device::Cuda(_) => match self.cuda.as_mut() {
                    Some(c) => match c.copy_out(&tensor)? {
                        Some(p) => Place::Pinned(p),
                        None => continue,
                    },
                    None => continue,
                },
                Device::Cpu => Place::Held(tensor.replace_storage(placeholder())),
                _ => continue,
            };
            self.stats.bytes += bytes;
            self.stats.tensors += 1;
            out.push(Stashed { tensor, place });
        }
        self.layers.entry(layer).or_default().extend(out);
        Ok(())
    }

    /// Starts bringing layer `layer`'s storages back (CUDA: on the copy stream; the CPU
    /// puts them back at once).
    pub(crate) fn prefetch(&mut self, layer: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(c) = self.cuda.as_mut() {
            c.release()?;
        }
        let Some(stashed) = self.layers.remove(&layer) else {
            return Ok(());
        };
        for s in stashed {
            match s.place {
                Place::Held(storage) => {
                    s.tensor.replace_storage(storage);
                }
                #[cfg(feature = "cuda")]
                Place::Pinned(p) => {
                    let c = self.cuda.as_mut().expect("pinned only with CUDA streams");
                    c.copy_back(&s.tensor, p)?;
                }
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(c) = self.cuda.as_mut() {
            c.mark_fetched(layer)?;
        }
        Ok(())
    }

    /// Makes sure layer `layer`'s storages are back before the compute that follows reads
    /// them (prefetching them now if that was not done).
    pub(crate) fn fetch(&mut self, layer: usize) -> Result<()> {
        self.prefetch(layer)?;
        #[cfg(feature = "cuda")]
        if let Some(c) = self.cuda.as_mut() {
            c.wait_fetched(layer)?;
        }
        Ok(())
    }
}

/// A storage that holds nothing: what a stashed tensor holds while its data is away. Any
/// op that reads it fails (a device or size mismatch), it never reads stale data.
fn placeholder() -> candle_core::Storage {
    candle_core::Storage::Cpu(candle_core::CpuStorage::U8(Vec::new()))
}

/// The tensors (one per storage) that only the autograd graph of `roots` holds: every
/// node of the graph that is not a variable, grouped by storage, kept where the number of
/// the graph's tensors holding the storage equals its number of holders, and no variable
/// holds it.
fn layer_owned(roots: &[&Tensor]) -> Vec<Tensor> {
    struct Group {
        first: Tensor,
        ids: Vec<candle_core::TensorId>,
        variable: bool,
    }
    let mut groups: HashMap<usize, Group> = HashMap::new();
    // Storages in the order the graphs list them (copies are issued in this order).
    let mut order = Vec::new();
    for root in roots {
        for node in root.sorted_nodes() {
            let g = groups.entry(node.storage_id()).or_insert_with(|| {
                order.push(node.storage_id());
                Group {
                    first: node.clone(),
                    ids: Vec::new(),
                    variable: false,
                }
            });
            if !g.ids.contains(&node.id()) {
                g.ids.push(node.id());
            }
            g.variable |= node.is_variable();
        }
    }
    order
        .into_iter()
        .filter_map(|k| groups.remove(&k))
        .filter(|g| !g.variable && g.first.storage_holders() == g.ids.len())
        .map(|g| g.first)
        .collect()
}

/// Bytes in use on a CUDA device's default memory pool at its highest since the last
/// [`reset_peak_device_memory`] (the allocations candle makes), or `None` off CUDA.
pub fn peak_device_memory(device: &Device) -> Result<Option<u64>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::pool_attribute(d, None).map(Some),
        _ => Ok(None),
    }
}

/// Starts a new peak for [`peak_device_memory`] (from what is in use now).
pub fn reset_peak_device_memory(device: &Device) -> Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => cuda::pool_attribute(d, Some(0)).map(|_| ()),
        _ => Ok(()),
    }
}

#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod cuda {
    //! The CUDA half: a copy stream, pinned buffers pooled by size, and the events that
    //! order copies against compute.

    use std::collections::HashMap;
    use std::sync::Arc;

    use candle_core::cuda_backend::cudarc::driver::{self, CudaEvent, CudaStream, PinnedHostSlice, sys};
    use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, WrapErr};
    use candle_core::{CudaStorage, DType, Storage, Tensor};

    use crate::{Error, Result};

    fn err(e: impl std::fmt::Display) -> Error {
        Error::Device(format!("activation offloading: {e}"))
    }

    /// A stashed storage's bytes in pinned host memory.
    pub(super) struct Pinned {
        buf: PinnedHostSlice<u8>,
        dtype: DType,
        len: usize,
    }

    /// The compute stream (candle's), the copy stream, the pool, and what is in flight.
    pub(super) struct Streams {
        main: Arc<CudaStream>,
        copy: Arc<CudaStream>,
        device: CudaDevice,
        /// Device storages whose copy to the host was issued, released one layer later.
        leaving: Vec<Storage>,
        /// Per layer being brought back: the event after its last copy was issued.
        fetched: HashMap<usize, CudaEvent>,
    }

    thread_local! {
        /// Pinned buffers by byte length, reused by every pass on this thread.
        static POOL: std::cell::RefCell<HashMap<usize, Vec<PinnedHostSlice<u8>>>> =
            std::cell::RefCell::new(HashMap::new());
    }

    impl Streams {
        pub(super) fn new(d: &CudaDevice) -> Result<Self> {
            let main = d.cuda_stream();
            let copy = main.context().new_stream().map_err(err)?;
            Ok(Streams {
                main,
                copy,
                device: d.clone(),
                leaving: Vec::new(),
                fetched: HashMap::new(),
            })
        }

        /// Called after a layer's forward was issued, before its activations are copied:
        /// the copy stream waits for that compute, and the device memory of the layer
        /// before (whose copies were issued a layer ago) is released, ordered after those
        /// copies.
        pub(super) fn after_compute(&mut self) -> Result<()> {
            self.release()?;
            let done = self.main.record_event(None).map_err(err)?;
            self.copy.wait(&done).map_err(err)?;
            Ok(())
        }

        /// Releases the device memory of storages whose copies were issued, ordered (on
        /// the device) after those copies.
        pub(super) fn release(&mut self) -> Result<()> {
            if !self.leaving.is_empty() {
                // The copies issued a layer ago (not this layer's, issued next): the compute
                // stream waits for them on the device before it may reuse their memory.
                let copied = self.copy.record_event(None).map_err(err)?;
                self.main.wait(&copied).map_err(err)?;
                self.leaving.clear();
            }
            Ok(())
        }

        /// Issues the copy of `t`'s storage to a pinned buffer and swaps a placeholder in;
        /// `None` leaves a tensor that is not plain CUDA data where it is.
        pub(super) fn copy_out(&mut self, t: &Tensor) -> Result<Option<Pinned>> {
            let (dtype, len) = (t.dtype(), storage_len(t));
            let bytes = len * dtype.size_in_bytes();
            if bytes == 0 {
                return Ok(None);
            }
            let mut buf = take_pinned(self.main.context(), bytes)?;
            {
                let (storage, _) = t.storage_and_layout();
                let Storage::Cuda(cs) = &*storage else {
                    return Ok(None);
                };
                macro_rules! copy {
                    ($($v:ident),*) => {
                        match &cs.slice {
                            $(CudaStorageSlice::$v(s) => {
                                // SAFETY: a view of the same allocation as bytes, `bytes`
                                // long (len elements of the dtype's size).
                                let v = unsafe { s.transmute::<u8>(bytes) }
                                    .ok_or_else(|| err(format!("a {dtype:?} storage of {len} elements is not {bytes} bytes")))?;
                                self.copy.memcpy_dtoh(&v, &mut buf).map_err(err)?;
                            })*
                            _ => return Ok(None),
                        }
                    };
                }
                copy!(U8, U32, I16, I32, I64, BF16, F16, F32, F64);
            }
            self.leaving.push(t.replace_storage(super::placeholder()));
            Ok(Some(Pinned { buf, dtype, len }))
        }

        /// Issues the copy of `p` back into a new device storage for `t`.
        pub(super) fn copy_back(&mut self, t: &Tensor, p: Pinned) -> Result<()> {
            let Pinned { buf, dtype, len } = p;
            let bytes = len * dtype.size_in_bytes();
            let stream = &self.main;
            macro_rules! back {
                ($($v:ident => $ty:ty),*) => {
                    match dtype {
                        $(DType::$v => {
                            // SAFETY: uninitialised device memory, fully written by the copy
                            // below before any kernel reads it (the compute stream waits for
                            // the copy's event in `wait_fetched`).
                            let mut s = unsafe { stream.alloc::<$ty>(len) }.map_err(err)?;
                            // The allocation is ordered on the compute stream.
                            let alloc = stream.record_event(None).map_err(err)?;
                            self.copy.wait(&alloc).map_err(err)?;
                            {
                                // SAFETY: the same allocation as bytes, `bytes` long.
                                let mut v = unsafe { s.transmute_mut::<u8>(bytes) }
                                    .ok_or_else(|| err(format!("{bytes} bytes do not fit {len} {dtype:?}")))?;
                                self.copy.memcpy_htod(&buf, &mut v).map_err(err)?;
                            }
                            CudaStorageSlice::$v(s)
                        })*
                        other => return Err(err(format!("no way back for a {other:?} tensor"))),
                    }
                };
            }
            let slice = back!(U8 => u8, U32 => u32, I16 => i16, I32 => i32, I64 => i64,
                BF16 => half::bf16, F16 => half::f16, F32 => f32, F64 => f64);
            t.replace_storage(Storage::Cuda(CudaStorage {
                slice,
                device: self.device.clone(),
            }));
            give_pinned(bytes, buf);
            Ok(())
        }

        /// Records that the copies of layer `layer` back to the device were all issued.
        pub(super) fn mark_fetched(&mut self, layer: usize) -> Result<()> {
            let e = self.copy.record_event(None).map_err(err)?;
            self.fetched.insert(layer, e);
            Ok(())
        }

        /// The compute stream waits (on the device) for layer `layer`'s copies back.
        pub(super) fn wait_fetched(&mut self, layer: usize) -> Result<()> {
            if let Some(e) = self.fetched.remove(&layer) {
                self.main.wait(&e).map_err(err)?;
            }
            Ok(())
        }
    }

    /// The element count of `t`'s storage (not of its view).
    fn storage_len(t: &Tensor) -> usize {
        let (s, _) = t.storage_and_layout();
        match &*s {
            Storage::Cuda(cs) => match &cs.slice {
                CudaStorageSlice::U8(s) => s.len(),
                CudaStorageSlice::U32(s) => s.len(),
                CudaStorageSlice::I16(s) => s.len(),
                CudaStorageSlice::I32(s) => s.len(),
                CudaStorageSlice::I64(s) => s.len(),
                CudaStorageSlice::BF16(s) => s.len(),
                CudaStorageSlice::F16(s) => s.len(),
                CudaStorageSlice::F32(s) => s.len(),
                CudaStorageSlice::F64(s) => s.len(),
                _ => 0,
            },
            _ => 0,
        }
    }

    fn take_pinned(ctx: &Arc<driver::CudaContext>, bytes: usize) -> Result<PinnedHostSlice<u8>> {
        if let Some(b) = POOL.with(|p| p.borrow_mut().get_mut(&bytes).and_then(|v| v.pop())) {
            return Ok(b);
        }
        // SAFETY: plain (not write-combined) pinned memory; only DMA copies touch it.
        unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(err)
    }

    fn give_pinned(bytes: usize, b: PinnedHostSlice<u8>) {
        POOL.with(|p| p.borrow_mut().entry(bytes).or_default().push(b));
    }

    /// Reads the default memory pool's `USED_MEM_HIGH` (or resets it to `reset`).
    pub(super) fn pool_attribute(d: &CudaDevice, reset: Option<u64>) -> Result<u64> {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(err)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        let mut v: u64 = reset.unwrap_or(0);
        // SAFETY: plain driver calls with out-pointers to locals of the types they write.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                .result()
                .w()?;
            match reset {
                Some(_) => sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast())
                    .result()
                    .w()?,
                None => sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast())
                    .result()
                    .w()?,
            }
        }
        Ok(v)
    }
}
