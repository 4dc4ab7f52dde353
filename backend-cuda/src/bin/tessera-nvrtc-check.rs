//! Compiles every kernel module with NVRTC for the architectures we support, without a GPU.
//!
//! `tessera-nvrtc-check [ARCH...]` (default: sm_80 sm_90 sm_100). Needs libnvrtc on the loader
//! path; `.ci/run` installs the `nvidia-cuda-nvrtc` wheel and points `LD_LIBRARY_PATH` at it.
//! Exits non-zero, printing NVRTC's log, when any module fails to compile.

use std::process::ExitCode;
use std::time::Instant;

use tessera_cuda::{Module, compile, nvrtc_version};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let archs: Vec<String> =
        if args.is_empty() { ["sm_80", "sm_90", "sm_100"].map(String::from).to_vec() } else { args };
    let (major, minor) = match nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("tessera-nvrtc-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("NVRTC {major}.{minor}");
    let mut failed = 0;
    for arch in &archs {
        for m in Module::ALL {
            let start = Instant::now();
            let target = compile::target(m, arch, true);
            match compile::compile(m, &target) {
                Ok(cubin) => println!(
                    "ok    {target:7} {:12} {:>8} bytes  {:>6.0} ms",
                    m.name(),
                    cubin.len(),
                    start.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {target:7} {:12}\n{e}", m.name());
                }
            }
        }
    }
    let total = archs.len() * Module::ALL.len();
    println!("{} of {total} module compiles passed", total - failed);
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
