//! Helpers shared by the reliability tests (issue 23): a counting allocator that measures the
//! heap a call uses (and refuses to let a runaway test take the machine), and builders of damaged
//! inputs: GGUFs with edited metadata, HF checkpoint directories with edited configs and tensors.
//!
//! Each test file declares `#[global_allocator] static A: common::Counting = common::Counting;`
//! and wraps what it measures in [`measure`], which also serialises the measured sections (tests
//! of one binary run in parallel threads, and the counters are process-wide).

#![allow(dead_code)] // each test binary uses a part

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value as Json;
use tessera_models::config::ModelConfig;
use tessera_models::gguf::{GgufFile, GgufWriter, Value};
use tessera_models::synth::synthesize;
use tessera_ops::DType;

/// Live heap bytes of the process, the most since the last [`measure`] began, and a cap beyond
/// which allocations fail (so code that sizes an allocation from a hostile count aborts this test
/// binary at 2 GiB instead of swapping the machine).
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
const CAP: usize = 2 << 30;

/// The system allocator, counting.
pub struct Counting;

impl Counting {
    fn grow(size: usize) -> bool {
        let now = LIVE.fetch_add(size, Ordering::Relaxed) + size;
        if now > CAP {
            LIVE.fetch_sub(size, Ordering::Relaxed);
            return false;
        }
        PEAK.fetch_max(now, Ordering::Relaxed);
        true
    }
}

// SAFETY: every call is forwarded to `System` with the same layout; the counters only observe.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !Self::grow(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !Self::grow(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (so from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !Self::grow(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded; `ptr` came from `System` with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > layout.size() {
                LIVE.fetch_sub(new_size - layout.size(), Ordering::Relaxed);
            }
        } else if new_size < layout.size() {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        p
    }
}

static MEASURING: Mutex<()> = Mutex::new(());

/// Holds the measuring lock (tests that allocate a lot take it too, so they do not run inside
/// another test's measured section).
pub fn exclusive() -> MutexGuard<'static, ()> {
    MEASURING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a measured call cost.
#[derive(Debug, Clone, Copy)]
pub struct Cost {
    /// Most heap bytes live at once during the call, beyond those live when it began.
    pub peak_heap: usize,
    pub time: Duration,
}

/// Runs `f` alone (see [`exclusive`]) and returns its result and [`Cost`].
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, Cost) {
    let _g = exclusive();
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t0 = Instant::now();
    let out = f();
    let time = t0.elapsed();
    let peak_heap = PEAK.load(Ordering::Relaxed).saturating_sub(base);
    (out, Cost { peak_heap, time })
}

/// A fresh directory under the temp dir (removed by the caller).
pub fn temp_dir(tag: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("tessera_rel_{tag}_{}_{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The bytes of a synthesized `preset` GGUF with f32 weights.
pub fn preset_bytes(preset: &str) -> Vec<u8> {
    let dir = temp_dir("preset");
    let path = dir.join("m.gguf");
    synthesize(&ModelConfig::preset(preset).unwrap(), DType::F32, 7, &path, None).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
    bytes
}

/// A copy of `f` with metadata `edits` applied (a `None` value removes the key; new keys are
/// appended) and the tensors that `keep` accepts, bytes and all.
pub fn edit_gguf(f: &GgufFile, edits: &[(&str, Option<Value>)], keep: impl Fn(&str) -> bool) -> GgufFile {
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        match edits.iter().find(|(ek, _)| ek == k) {
            Some((_, Some(ev))) => {
                w.add_kv(k.clone(), ev.clone()).unwrap();
            }
            Some((_, None)) => {}
            None => {
                w.add_kv(k.clone(), v.clone()).unwrap();
            }
        }
    }
    for (k, v) in edits {
        if f.get(k).is_none()
            && let Some(v) = v
        {
            w.add_kv(k.to_string(), v.clone()).unwrap();
        }
    }
    for t in f.tensors() {
        if keep(&t.name) {
            w.add_tensor(t.name.clone(), t.dtype, t.dims(), f.tensor_data(&t.name).unwrap()).unwrap();
        }
    }
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

/// [`edit_gguf`] keeping every tensor.
pub fn with_kvs(f: &GgufFile, edits: &[(&str, Option<Value>)]) -> GgufFile {
    edit_gguf(f, edits, |_| true)
}

/// The repository's `fixtures/hf/NAME`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf").join(name)
}

/// One tensor of an HF checkpoint being built: name, dtype, shape, bytes.
pub type StTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// The tensors of fixture `name` (all f32).
pub fn fixture_tensors(name: &str) -> Vec<StTensor> {
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<StTensor> =
        st.iter().map(|(n, t)| (n.to_string(), t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The parsed `config.json` of fixture `name`.
pub fn fixture_config(name: &str) -> Json {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap()
}

/// Writes an HF checkpoint directory: `config.json` and one `model.safetensors`.
pub fn write_checkpoint(dir: &Path, config: &Json, tensors: &[StTensor]) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    let views =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect::<Vec<_>>();
    std::fs::write(dir.join("model.safetensors"), safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
