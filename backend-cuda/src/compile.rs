//! Kernel sources, NVRTC compilation and the on-disk cache.
//!
//! Each op family (mul_mat / mul_mat_id: each of its kernel families) is one `.cu` file in
//! `backend-cuda/kernels/` (a [`Module`]), compiled as a whole with `common.cuh` prepended (and
//! the headers it shares with other modules, [`Module::headers`]: the matmul modules'
//! `matmul.cuh`, reduce's and delta_net's `norm.cuh`, the attention modules' `attention.cuh`), to a CUBIN for the device's architecture, the first time one of its kernels is
//! launched. The CUBIN is cached on disk under a SHA-256 of the source, the options, the
//! architecture and the NVRTC version, so a second process loads it without compiling.
//! A compile error carries NVRTC's log and names the kernel that needed the module.
//!
//! Generated modules ([`Generated`]: one per `elementwise` program, made by
//! `ops/elemfuse.rs`) go through the same compile and disk cache, their source being a built-in
//! module's (whose device functions they call) followed by the generated text; in memory they
//! are kept per program (`Kernels::program`), so a program compiles once per process and once
//! per kernel cache.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, sys};
use cudarc::nvrtc::sys as nvrtc_sys;
use sha2::{Digest, Sha256};
use tessera_ops::ElemProgram;

use crate::CudaError;

const COMMON: &str = include_str!("../kernels/common.cuh");
const MATMUL: &str = include_str!("../kernels/matmul.cuh");
const NORM: &str = include_str!("../kernels/norm.cuh");
const ROPE: &str = include_str!("../kernels/rope.cuh");
const QUANT_MMA: &str = include_str!("../kernels/quant_mma.cuh");
const ATTENTION: &str = include_str!("../kernels/attention.cuh");
const DELTA_NET: &str = include_str!("../kernels/delta_net.cuh");

/// One kernel source file: an op family, or one kernel family of mul_mat / mul_mat_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Module {
    Elementwise,
    Data,
    Reduce,
    Rope,
    Quant,
    /// The matmul paths' packing and dequantizing (`pack_b`, `dequant_rows`).
    Pack,
    /// mul_mat at 1-8 tokens a pass: the warp and fast GEMVs.
    Gemv,
    /// mul_mat of one token against one matrix: the ring and word GEMVs.
    GemvOne,
    /// mul_mat_id off the tensor cores: the decode, grouped and weighted-sum kernels.
    Moe,
    /// mul_mat of f32 weights for many tokens: the split-tf32 tensor-core GEMM.
    GemmF32,
    /// mul_mat and mul_mat_id of q8_0 / nvfp4 weights for many tokens: the tiled tensor-core GEMM.
    Mmq,
    /// mul_mat_id with few pairs an expert on tensor cores: the grouping and the routed experts.
    MoeMma,
    /// flash_attn_ext off the tensor cores: the SIMT kernel and the combine of split partials.
    Attention,
    /// flash_attn_ext's prefill on tensor cores (`wgmma` on Hopper).
    AttentionPrefill,
    /// flash_attn_ext's decode on tensor cores.
    AttentionDecode,
    Conv,
    /// gated_delta_net: the slot check, the serial and tiled kernels, the fused op's input prep.
    DeltaNet,
    /// gated_delta_net's chunked form on tensor cores (`wgmma` on Hopper), for long sequences.
    DeltaNetChunked,
    Sample,
    Fused,
}

impl Module {
    /// Every module, for the compile check.
    pub const ALL: [Module; 20] = [
        Module::Elementwise,
        Module::Data,
        Module::Reduce,
        Module::Rope,
        Module::Quant,
        Module::Pack,
        Module::Gemv,
        Module::GemvOne,
        Module::Moe,
        Module::GemmF32,
        Module::Mmq,
        Module::MoeMma,
        Module::Attention,
        Module::AttentionPrefill,
        Module::AttentionDecode,
        Module::Conv,
        Module::DeltaNet,
        Module::DeltaNetChunked,
        Module::Sample,
        Module::Fused,
    ];

    /// The architectures whose architecture-specific features (the `a` targets) the module's
    /// source uses when present: the `wgmma` paths of `mmq`, of the prefill attention and of the
    /// chunked delta rule's in-order pass on Hopper.
    pub const fn arch_specific_on(self) -> &'static [&'static str] {
        match self {
            Module::Mmq | Module::AttentionPrefill | Module::DeltaNetChunked => &["sm_90"],
            _ => &[],
        }
    }

    /// The file stem in `kernels/`.
    pub const fn name(self) -> &'static str {
        match self {
            Module::Elementwise => "elementwise",
            Module::Data => "data",
            Module::Reduce => "reduce",
            Module::Rope => "rope",
            Module::Quant => "quant",
            Module::Pack => "pack",
            Module::Gemv => "gemv",
            Module::GemvOne => "gemv_one",
            Module::Moe => "moe",
            Module::GemmF32 => "gemm_f32",
            Module::Mmq => "mmq",
            Module::MoeMma => "moe_mma",
            Module::Attention => "attention",
            Module::AttentionPrefill => "attention_prefill",
            Module::AttentionDecode => "attention_decode",
            Module::Conv => "conv",
            Module::DeltaNet => "delta_net",
            Module::DeltaNetChunked => "delta_net_chunked",
            Module::Sample => "sample",
            Module::Fused => "fused",
        }
    }

    fn body(self) -> &'static str {
        match self {
            Module::Elementwise => include_str!("../kernels/elementwise.cu"),
            Module::Data => include_str!("../kernels/data.cu"),
            Module::Reduce => include_str!("../kernels/reduce.cu"),
            Module::Rope => include_str!("../kernels/rope.cu"),
            Module::Quant => include_str!("../kernels/quant.cu"),
            Module::Pack => include_str!("../kernels/pack.cu"),
            Module::Gemv => include_str!("../kernels/gemv.cu"),
            Module::GemvOne => include_str!("../kernels/gemv_one.cu"),
            Module::Moe => include_str!("../kernels/moe.cu"),
            Module::GemmF32 => include_str!("../kernels/gemm_f32.cu"),
            Module::Mmq => include_str!("../kernels/mmq.cu"),
            Module::MoeMma => include_str!("../kernels/moe_mma.cu"),
            Module::Attention => include_str!("../kernels/attention.cu"),
            Module::AttentionPrefill => include_str!("../kernels/attention_prefill.cu"),
            Module::AttentionDecode => include_str!("../kernels/attention_decode.cu"),
            Module::Conv => include_str!("../kernels/conv.cu"),
            Module::DeltaNet => include_str!("../kernels/delta_net.cu"),
            Module::DeltaNetChunked => include_str!("../kernels/delta_net_chunked.cu"),
            Module::Sample => include_str!("../kernels/sample.cu"),
            Module::Fused => include_str!("../kernels/fused.cu"),
        }
    }

    /// The headers compiled between `common.cuh` and the module's file, by file name and built-in
    /// text: device code that several modules share (NVRTC is given no include files, so a
    /// module's translation unit is its headers' text and its own).
    pub const fn headers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Module::Pack | Module::Gemv | Module::Moe => &[("matmul.cuh", MATMUL)],
            Module::Mmq | Module::MoeMma => &[("quant_mma.cuh", QUANT_MMA)],
            Module::Attention | Module::AttentionPrefill | Module::AttentionDecode => &[("attention.cuh", ATTENTION)],
            Module::Reduce => &[("norm.cuh", NORM)],
            Module::DeltaNet => &[("norm.cuh", NORM), ("delta_net.cuh", DELTA_NET)],
            Module::DeltaNetChunked => &[("delta_net.cuh", DELTA_NET)],
            Module::Rope => &[("rope.cuh", ROPE)],
            Module::Fused => &[("norm.cuh", NORM), ("rope.cuh", ROPE)],
            _ => &[],
        }
    }

    /// The full translation unit NVRTC compiles: `common.cuh`, the module's [`Module::headers`],
    /// then the family's file (each after a `#line` so NVRTC's messages name the right file and
    /// line); files in `$TESSERA_KERNEL_DIR` replace the built-in ones ([`Module::source_from`]).
    pub fn source(self) -> String {
        self.source_from(std::env::var_os("TESSERA_KERNEL_DIR").map(PathBuf::from).as_deref())
    }

    /// [`Module::source`] with the files of `dir` that can be read (`common.cuh`, the headers,
    /// `<name>.cu`) in place of the copies built into the binary: kernel changes can be tried on
    /// a GPU machine without a Rust toolchain. The cache key hashes this text, so such CUBINs
    /// never stand in for the built-in ones.
    pub fn source_from(self, dir: Option<&Path>) -> String {
        let read = |file: &str, builtin: &'static str| -> Cow<'static, str> {
            dir.and_then(|d| std::fs::read_to_string(d.join(file)).ok()).map_or(Cow::Borrowed(builtin), Cow::Owned)
        };
        let mut source = format!("#line 1 \"common.cuh\"\n{}\n", read("common.cuh", COMMON));
        for &(file, builtin) in self.headers() {
            source += &format!("#line 1 \"{file}\"\n{}\n", read(file, builtin));
        }
        let body = read(&format!("{}.cu", self.name()), self.body());
        source + &format!("#line 1 \"{}.cu\"\n{body}", self.name())
    }
}

/// One kernel entry point: a `extern "C" __global__` function of a module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub module: Module,
    pub name: &'static str,
}

impl Kernel {
    pub const fn new(module: Module, name: &'static str) -> Kernel {
        Kernel { module, name }
    }
}

/// The NVRTC target of `module` on a device of architecture `arch` (such as `sm_90`): the
/// architecture-specific variant (`sm_90a`) where the module has a path for it
/// ([`Module::arch_specific_on`]) and `arch_specific` is on; otherwise `arch`, where every module
/// takes its portable path. A CUBIN for `sm_90a` runs on compute capability 9.0 only.
pub fn target(module: Module, arch: &str, arch_specific: bool) -> String {
    if arch_specific && module.arch_specific_on().contains(&arch) { format!("{arch}a") } else { arch.into() }
}

/// NVRTC options for a target such as `sm_90` or `sm_90a`.
pub fn options(target: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={target}"), "--std=c++17".into(), "--device-as-default-execution-space".into()]
}

/// Compiles `module` to a CUBIN for `target` ([`target`]) with NVRTC. Needs only libnvrtc, not a
/// GPU (this is what the CI compile check runs).
pub fn compile(module: Module, target: &str) -> Result<Vec<u8>, CudaError> {
    compile_source(module.name(), &module.source(), target)
}

/// Compiles a whole translation unit `source` (named `label` in errors) to a CUBIN for `target`.
pub fn compile_source(label: &'static str, source: &str, target: &str) -> Result<Vec<u8>, CudaError> {
    compile_with(label, source, target, false).map(|(cubin, _)| cubin)
}

/// [`compile`], also returning what ptxas reports for each kernel entry (registers, spills,
/// stack, static shared memory): the same CUBIN, compiled with `--ptxas-options=-v`.
pub fn compile_reporting(module: Module, target: &str) -> Result<(Vec<u8>, Vec<KernelResources>), CudaError> {
    compile_with(module.name(), &module.source(), target, true).map(|(cubin, log)| (cubin, parse_resources(&log)))
}

/// What ptxas reports for one kernel entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub name: String,
    pub registers: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Static (`__shared__`) bytes; dynamic shared memory is the launch's.
    pub static_shared: u32,
    /// ptxas's performance warnings for the entry (such as "wgmma.mma_async instructions are
    /// serialized due to ..."), as written.
    pub warnings: Vec<String>,
}

/// The kernel entries of a `--ptxas-options=-v` log, in the order ptxas compiled them. ptxas
/// writes, per entry, "Compiling entry function 'NAME'", "Function properties for NAME" followed by
/// the stack and spill bytes, then "Used R registers, ... S bytes smem"; device functions that
/// were not inlined get properties lines too, which are skipped. ptxas's "Potential Performance
/// Loss" lines (written before the entries, each naming its function) go to the entry they name.
pub fn parse_resources(log: &str) -> Vec<KernelResources> {
    // the integer just before `unit` in `line` ("12 bytes spill stores" -> 12 for "bytes spill stores")
    fn count(line: &str, unit: &str) -> Option<u32> {
        let at = line.find(unit)?;
        line[..at].split(|c: char| !c.is_ascii_digit()).rfind(|w| !w.is_empty())?.parse().ok()
    }
    fn quoted(line: &str) -> Option<&str> {
        line.split('\'').nth(1)
    }
    let mut out: Vec<KernelResources> = Vec::new();
    let mut props_for_entry = false;
    let mut warnings: Vec<(&str, String)> = Vec::new(); // (line, what it says)
    for line in log.lines() {
        if let Some(what) = line.split("Potential Performance Loss").nth(1) {
            warnings.push((line, what.trim_start_matches(':').trim().to_string()));
        } else if line.contains("Compiling entry function") {
            if let Some(name) = quoted(line) {
                out.push(KernelResources { name: name.to_string(), ..Default::default() });
            }
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_for_entry = out.last().is_some_and(|k| k.name == rest.trim());
        } else if line.contains("bytes stack frame") {
            if props_for_entry && let Some(k) = out.last_mut() {
                k.stack_bytes = count(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = count(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = count(line, "bytes spill loads").unwrap_or(0);
            }
            props_for_entry = false;
        } else if line.contains("Used ")
            && line.contains(" registers")
            && let Some(k) = out.last_mut()
        {
            k.registers = count(line, " registers").unwrap_or(0);
            k.static_shared = count(line, " bytes smem").unwrap_or(0);
        }
    }
    for (line, what) in warnings {
        if let Some(k) = out.iter_mut().find(|k| line.contains(&format!("'{}'", k.name))) {
            k.warnings.push(what);
        }
    }
    out
}

/// Compiles `source` for `target`; with `verbose`, ptxas reports each entry's resources into the
/// returned log (the CUBIN is the same).
fn compile_with(
    label: &'static str,
    source: &str,
    target: &str,
    verbose: bool,
) -> Result<(Vec<u8>, String), CudaError> {
    crate::device::nvrtc_version()?;
    let src = CString::new(source).map_err(|_| CudaError::Nvrtc("kernel source contains a NUL byte".into()))?;
    let name = CString::new(format!("{label}.cu")).expect("module names have no NUL");
    let mut opts = options(target);
    if verbose {
        opts.push("--ptxas-options=-v".into());
    }
    let fail = |what: &str, r: nvrtc_sys::nvrtcResult| CudaError::Nvrtc(format!("{what} for {label}: {r:?}"));
    let mut prog: nvrtc_sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers are passed.
    let r = unsafe {
        nvrtc_sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", r));
    }
    struct Prog(nvrtc_sys::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above and destroyed once.
            unsafe { nvrtc_sys::nvrtcDestroyProgram(&mut self.0) };
        }
    }
    let prog = Prog(prog);
    let c_opts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).expect("options have no NUL")).collect();
    let ptrs: Vec<*const std::ffi::c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `ptrs` holds `ptrs.len()` valid C strings alive for the call.
    let r = unsafe { nvrtc_sys::nvrtcCompileProgram(prog.0, ptrs.len() as i32, ptrs.as_ptr()) };
    let log = program_log(prog.0);
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::Compile { module: label, arch: target.to_string(), log });
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a valid out-pointer.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcGetCUBINSize", r));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC reported.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcGetCUBIN", r));
    }
    Ok((cubin, log))
}

fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: valid program and out-pointer.
    if unsafe { nvrtc_sys::nvrtcGetProgramLogSize(prog, &mut size) } != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` has the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) };
    String::from_utf8_lossy(&buf).trim_end_matches('\0').trim_end().to_string()
}

/// Where compiled kernels are cached: `$TESSERA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tessera/kernels`,
/// else `~/.cache/tessera/kernels`, else a folder under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TESSERA_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("tessera/kernels");
    }
    if let Some(h) = std::env::var_os("HOME") {
        return PathBuf::from(h).join(".cache/tessera/kernels");
    }
    std::env::temp_dir().join("tessera-kernels")
}

/// The cache key: everything that changes the CUBIN.
pub fn cache_key(module: Module, target: &str, nvrtc: (i32, i32)) -> String {
    source_key(&module.source(), target, nvrtc)
}

/// The file in [`cache_dir`] that holds `module`'s CUBIN for `target` under NVRTC `nvrtc`.
pub fn cache_file_name(module: Module, target: &str, nvrtc: (i32, i32)) -> String {
    format!("{}-{target}-{}.cubin", module.name(), cache_key(module, target, nvrtc))
}

/// [`cache_key`] of a whole translation unit.
pub fn source_key(source: &str, target: &str, nvrtc: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options(target) {
        h.update(o.as_bytes());
        h.update([0]);
    }
    h.update(target.as_bytes());
    h.update(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    let digest = h.finalize();
    digest.iter().take(12).map(|b| format!("{b:02x}")).collect()
}

/// A module generated at run time: `body` (with its `extern "C"` entries `entries`) compiled
/// after the source of `base`, whose device functions it may call. `label` names it in errors
/// and cache file names.
#[derive(Debug, Clone)]
pub struct Generated {
    pub label: &'static str,
    pub base: Module,
    pub body: String,
    pub entries: Vec<String>,
}

impl Generated {
    /// The full translation unit NVRTC compiles.
    pub fn source(&self) -> String {
        format!("{}\n#line 1 \"{}.cu\"\n{}", self.base.source(), self.label, self.body)
    }
}

/// Statistics of the kernel registry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Modules compiled by NVRTC in this process.
    pub compiled: u64,
    /// Modules loaded from the disk cache.
    pub cache_hits: u64,
}

/// Loaded modules and functions of one context; compiles on first use.
pub(crate) struct Kernels {
    ctx: Arc<CudaContext>,
    arch: String,
    arch_specific: bool,
    nvrtc: (i32, i32),
    modules: HashMap<Module, Arc<CudaModule>>,
    functions: HashMap<Kernel, CudaFunction>,
    /// The entries of each program's generated module, with their names (leaked once per
    /// program: the step trace holds `&'static str`).
    programs: HashMap<ElemProgram, Vec<(&'static str, CudaFunction)>>,
    /// [`Kernels::resident_clusters`]'s answers by kernel, block size and shared memory.
    clusters: HashMap<(Kernel, u32, u32), u64>,
    pub stats: CompileStats,
}

impl Kernels {
    pub fn new(ctx: Arc<CudaContext>, arch: String, arch_specific: bool, nvrtc: (i32, i32)) -> Kernels {
        let (modules, functions) = (HashMap::new(), HashMap::new());
        let (programs, clusters) = (HashMap::new(), HashMap::new());
        Kernels {
            ctx,
            arch,
            arch_specific,
            nvrtc,
            modules,
            functions,
            programs,
            clusters,
            stats: CompileStats::default(),
        }
    }

    /// How many clusters of `kernel` (a kernel with a compile-time cluster shape of `cluster`
    /// blocks along y, `threads` a block and `shared` bytes of dynamic shared memory) the GPU runs
    /// at once: a grid of more waits for a second wave. Asked of the driver once, after raising
    /// the kernel's dynamic shared memory limit to `shared` (the query needs it).
    pub fn resident_clusters(
        &mut self,
        kernel: Kernel,
        cluster: u32,
        threads: u32,
        shared: u32,
    ) -> Result<u64, CudaError> {
        if let Some(&n) = self.clusters.get(&(kernel, threads, shared)) {
            return Ok(n);
        }
        let f = self.get(kernel)?;
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
            .map_err(|e| CudaError::Driver {
                what: format!("raising the shared memory of kernel {}", kernel.name),
                detail: e.to_string(),
            })?;
        let f = f.cu_function();
        let config = sys::CUlaunchConfig {
            gridDimX: 1,
            gridDimY: cluster,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: std::ptr::null_mut(),
            attrs: std::ptr::null_mut(),
            numAttrs: 0,
        };
        let mut n = 0;
        // SAFETY: a loaded function and a plain-data config without attributes (the cluster
        // shape is the function's own); `n` is written by the driver.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &config) }.result().map_err(|e| CudaError::Driver {
            what: format!("the resident clusters of kernel {}", kernel.name),
            detail: e.to_string(),
        })?;
        let n = n.max(0) as u64;
        self.clusters.insert((kernel, threads, shared), n);
        Ok(n)
    }

    /// Whether `module` is compiled for the device's architecture-specific target (its sm_90a
    /// paths run), which can change a kernel's launch shape.
    pub fn arch_specific_for(&self, module: Module) -> bool {
        target(module, &self.arch, self.arch_specific) != self.arch
    }

    /// The entries of `program`'s generated module (in the order `make().entries` lists them),
    /// compiling it with `make()`'s source, or loading it from the disk cache, the first time.
    pub fn program(
        &mut self,
        program: &ElemProgram,
        make: impl FnOnce() -> Generated,
    ) -> Result<&[(&'static str, CudaFunction)], CudaError> {
        if !self.programs.contains_key(program) {
            let g = make();
            let source = g.source();
            let target = target(g.base, &self.arch, false);
            let key = source_key(&source, &target, self.nvrtc);
            let path = cache_dir().join(format!("{}-{target}-{key}.cubin", g.label));
            let module = self.load_cubin(&path, g.label, || compile_source(g.label, &source, &target))?;
            let mut entries = Vec::new();
            for e in &g.entries {
                let f = module.load_function(e).map_err(|err| CudaError::Driver {
                    what: format!("loading kernel {e} from generated {}.cu", g.label),
                    detail: err.to_string(),
                })?;
                entries.push((&*Box::leak(e.clone().into_boxed_str()), f));
            }
            self.programs.insert(program.clone(), entries);
        }
        Ok(&self.programs[program])
    }

    /// The module cached at `path`, or `compile()`d, stored there and loaded.
    fn load_cubin(
        &mut self,
        path: &Path,
        label: &str,
        compile: impl FnOnce() -> Result<Vec<u8>, CudaError>,
    ) -> Result<Arc<CudaModule>, CudaError> {
        let load = |cubin: Vec<u8>| {
            self.ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| CudaError::Driver { what: format!("loading module {label}.cu"), detail: e.to_string() })
        };
        // A cached CUBIN the driver will not load (damaged, or carried from elsewhere: see
        // tessera-nvrtc-check --cache-dir) is compiled again and replaced, not an error.
        if let Ok(bytes) = std::fs::read(path)
            && !bytes.is_empty()
            && let Ok(module) = load(bytes)
        {
            self.stats.cache_hits += 1;
            return Ok(module);
        }
        let bytes = compile()?;
        self.stats.compiled += 1;
        store_in_cache(path, &bytes);
        load(bytes)
    }

    /// The function for `kernel`, compiling or loading its module first if needed.
    pub fn get(&mut self, kernel: Kernel) -> Result<&CudaFunction, CudaError> {
        if !self.functions.contains_key(&kernel) {
            let module = self.module(kernel)?;
            let f = module.load_function(kernel.name).map_err(|e| CudaError::Driver {
                what: format!("loading kernel {} from {}.cu", kernel.name, kernel.module.name()),
                detail: e.to_string(),
            })?;
            self.functions.insert(kernel, f);
        }
        Ok(&self.functions[&kernel])
    }

    /// Compiles or loads every module.
    pub fn load_all(&mut self) -> Result<(), CudaError> {
        for m in Module::ALL {
            self.module(Kernel::new(m, "(warm-up)"))?;
        }
        Ok(())
    }

    fn module(&mut self, kernel: Kernel) -> Result<Arc<CudaModule>, CudaError> {
        if let Some(m) = self.modules.get(&kernel.module) {
            return Ok(m.clone());
        }
        let target = target(kernel.module, &self.arch, self.arch_specific);
        let path = cache_dir().join(cache_file_name(kernel.module, &target, self.nvrtc));
        let module = self.load_cubin(&path, kernel.module.name(), || {
            compile(kernel.module, &target).map_err(|e| match e {
                CudaError::Compile { module, arch, log } => {
                    CudaError::Compile { module, arch, log: format!("(needed by kernel {})\n{log}", kernel.name) }
                }
                other => other,
            })
        })?;
        self.modules.insert(kernel.module, module.clone());
        Ok(module)
    }
}

/// Best effort: a cache that cannot be written only costs a recompile next time. Written
/// atomically ([`tessera_files::write_atomic`]: a temporary named by pid and counter in the same
/// directory, renamed when complete), so processes compiling the same module at once, or one
/// interrupted while writing, never leave a partial CUBIN under the final name.
fn store_in_cache(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let _ = tessera_files::write_atomic(path, bytes);
}

/// The kernels in `source` (a module or a generated program) whose body does not begin with
/// `grid_begin();` (after any `l2_prefetch_rows(..);`): launched with overlap ([`crate::launch`]'s `Launch`), such a kernel could
/// read its inputs before the kernel that writes them has finished.
#[cfg(test)]
pub(crate) fn kernels_without_grid_begin(source: &str) -> Vec<String> {
    let mut missing = Vec::new();
    for (at, _) in source.match_indices("__global__") {
        let head = &source[at..];
        let Some(open) = head.find('{') else { continue };
        let name = head[..open]
            .split('(')
            .filter_map(|before| before.split_whitespace().last())
            .find(|word| *word != "__launch_bounds__" && *word != "__global__")
            .unwrap_or("?");
        fn skip(t: &str) -> &str {
            t.trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
        }
        let mut body = skip(&head[open + 1..]);
        // L2 prefetches may come first: they cannot make a stale value visible
        while let Some(rest) = body.strip_prefix("l2_prefetch_rows(") {
            body = rest.split_once(';').map_or("", |(_, after)| skip(after));
        }
        if !body.starts_with("grid_begin();") {
            missing.push(name.to_string());
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::{KernelResources, Module, kernels_without_grid_begin, parse_resources, store_in_cache};

    #[test]
    fn ptxas_reports_parse_per_entry() {
        // NVRTC 13.0's log for two entries and a device function that was not inlined
        let log = "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to x in the function 'fa_mma_f16_d256' in line 0
ptxas info    : 145 bytes gmem
ptxas info    : Compiling entry function 'rope_multi' for 'sm_90'
ptxas info    : Function properties for rope_multi
ptxas         .     40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 39 registers, used 1 barriers, 40 bytes cumulative stack size
ptxas info    : Compile time = 64.088 ms
ptxas info    : Function properties for __internal_accurate_pow
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'fa_mma_f16_d256' for 'sm_90'
ptxas info    : Function properties for fa_mma_f16_d256
ptxas         .     0 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 544 bytes smem";
        let k = |name: &str, registers, stack_bytes, spill_stores, spill_loads, static_shared| KernelResources {
            name: name.into(),
            registers,
            stack_bytes,
            spill_stores,
            spill_loads,
            static_shared,
            warnings: Vec::new(),
        };
        let mut fa = k("fa_mma_f16_d256", 255, 0, 16, 24, 544);
        fa.warnings.push(
            "wgmma.mma_async instructions are serialized due to x in the function 'fa_mma_f16_d256' in line 0".into(),
        );
        assert_eq!(parse_resources(log), [k("rope_multi", 39, 40, 0, 0, 0), fa]);
        assert_eq!(parse_resources(""), []);
    }

    #[test]
    fn every_kernel_begins_by_waiting_for_the_previous_grid() {
        let mut kernels = 0;
        for m in Module::ALL {
            let src = m.source_from(None);
            kernels += src.matches("__global__").count();
            assert_eq!(kernels_without_grid_begin(&src), Vec::<String>::new(), "in {}.cu", m.name());
        }
        assert!(kernels > 90, "found {kernels} kernels");
        // The checker itself finds a kernel that does not wait.
        let bad = "extern \"C\" __global__ void ok(Tensor a) { grid_begin(); }\n\
                   extern \"C\" __global__ void __launch_bounds__(256) late(Tensor a) {\n    int i = 0;\n    grid_begin();\n}\n\
                   extern \"C\" __global__ void warm(Tensor a) { l2_prefetch_rows(a, 0, 0, 1); grid_begin(); }";
        assert_eq!(kernels_without_grid_begin(bad), ["late"]);
    }

    #[test]
    fn the_cache_is_written_whole_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("tessera-kernel-cache-test-{}", std::process::id()));
        let path = dir.join("rope-sm_90-0123.cubin");
        store_in_cache(&path, b"first");
        store_in_cache(&path, b"second");
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from("rope-sm_90-0123.cubin")], "no temporary left");
        // A cache that cannot be written (its folder is a file) is no error.
        store_in_cache(&path.join("x.cubin"), b"x");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
