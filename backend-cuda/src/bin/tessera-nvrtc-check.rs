//! Compiles every kernel module with NVRTC for the architectures we support, without a GPU.
//!
//! `tessera-nvrtc-check [--resources] [--cubin-dir DIR] [--cache-dir DIR] [--module NAME] [ARCH...]` (default archs:
//! sm_80 sm_90 sm_100). Needs libnvrtc on the loader path; `.ci/run` installs the
//! `nvidia-cuda-nvrtc` wheel and points `LD_LIBRARY_PATH` at it. Exits non-zero, printing NVRTC's
//! log, when any module fails to compile.
//!
//! For kernel work: `--resources` prints what ptxas reports for every kernel (registers, spill
//! bytes, stack, static shared memory: what decides occupancy, and whether a change spilled;
//! ptxas's performance warnings, such as serialized wgmma, under the kernel they name),
//! `--cubin-dir DIR` writes each CUBIN as `DIR/<module>.<target>.cubin` (for `cuobjdump -sass`),
//! and `--module NAME` (repeatable) limits the run to those modules.
//!
//! `--cache-dir DIR` writes each CUBIN under the name the backend's disk cache looks for
//! (`compile::cache_file_name`: the source, options, target and NVRTC version), so that a GPU
//! machine whose NVRTC has the same major.minor version loads them instead of compiling every
//! module on its first use: point `TESSERA_KERNEL_CACHE` at a copy of DIR there. The CUBINs are
//! only found by binaries whose built-in kernels are the sources compiled here.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use tessera_cuda::{Module, compile, nvrtc_version};

struct Args {
    archs: Vec<String>,
    modules: Vec<Module>,
    resources: bool,
    cubin_dir: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { archs: Vec::new(), modules: Vec::new(), resources: false, cubin_dir: None, cache_dir: None };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--resources" => args.resources = true,
            "--cubin-dir" => args.cubin_dir = Some(it.next().ok_or("--cubin-dir needs a directory")?.into()),
            "--cache-dir" => args.cache_dir = Some(it.next().ok_or("--cache-dir needs a directory")?.into()),
            "--module" => {
                let name = it.next().ok_or("--module needs a module name")?;
                let m = Module::ALL.into_iter().find(|m| m.name() == name).ok_or_else(|| {
                    let names: Vec<&str> = Module::ALL.iter().map(|m| m.name()).collect();
                    format!("no module {name:?} (modules: {})", names.join(", "))
                })?;
                args.modules.push(m);
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            arch => args.archs.push(arch.to_string()),
        }
    }
    if args.archs.is_empty() {
        args.archs = ["sm_80", "sm_90", "sm_100"].map(String::from).to_vec();
    }
    if args.modules.is_empty() {
        args.modules = Module::ALL.to_vec();
    }
    Ok(args)
}

fn main() -> ExitCode {
    // a closed stdout (`| head`) ends the run quietly instead of panicking in println!
    match run() {
        Ok(code) => code,
        Err(_) => ExitCode::FAILURE,
    }
}

fn run() -> std::io::Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tessera-nvrtc-check: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let (major, minor) = match nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("tessera-nvrtc-check: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    writeln!(out, "NVRTC {major}.{minor}")?;
    for dir in [&args.cubin_dir, &args.cache_dir].into_iter().flatten() {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("tessera-nvrtc-check: cannot create {}: {e}", dir.display());
            return Ok(ExitCode::FAILURE);
        }
    }
    let mut failed = 0;
    for arch in &args.archs {
        for &m in &args.modules {
            let start = Instant::now();
            let target = compile::target(m, arch, true);
            let compiled = if args.resources {
                compile::compile_reporting(m, &target)
            } else {
                compile::compile(m, &target).map(|cubin| (cubin, Vec::new()))
            };
            match compiled {
                Ok((cubin, kernels)) => {
                    writeln!(
                        out,
                        "ok    {target:7} {:12} {:>8} bytes  {:>6.0} ms",
                        m.name(),
                        cubin.len(),
                        start.elapsed().as_secs_f64() * 1e3
                    )?;
                    for k in &kernels {
                        let spills = if k.spill_stores + k.spill_loads > 0 {
                            format!("  SPILLS {} / {} bytes (stores / loads)", k.spill_stores, k.spill_loads)
                        } else {
                            String::new()
                        };
                        writeln!(
                            out,
                            "        {:40} {:>3} registers {:>5} bytes stack {:>6} bytes smem{spills}",
                            k.name, k.registers, k.stack_bytes, k.static_shared
                        )?;
                        for w in &k.warnings {
                            writeln!(out, "            ptxas: {w}")?;
                        }
                    }
                    let named = [
                        args.cubin_dir.as_ref().map(|d| d.join(format!("{}.{target}.cubin", m.name()))),
                        args.cache_dir.as_ref().map(|d| d.join(compile::cache_file_name(m, &target, (major, minor)))),
                    ];
                    for path in named.into_iter().flatten() {
                        if let Err(e) = tessera_files::write_atomic(&path, &cubin) {
                            failed += 1;
                            writeln!(out, "FAIL  writing {}: {e}", path.display())?;
                        }
                    }
                }
                Err(e) => {
                    failed += 1;
                    writeln!(out, "FAIL  {target:7} {:12}\n{e}", m.name())?;
                }
            }
        }
    }
    let total = args.archs.len() * args.modules.len();
    writeln!(out, "{} of {total} module compiles passed", total - failed)?;
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
