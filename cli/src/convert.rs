//! `tessera convert --from-hf DIR --out FILE [--dtype f32|f16|bf16|q8_0|nvfp4]`.

use std::path::Path;

use tessera_models::convert::convert;
use tessera_models::gguf::GgufFile;
use tessera_ops::DType;

/// Converts the HF Qwen3.5 checkpoint in `dir` to `out`, re-opens it and checks its tensors
/// against the config, then prints a summary.
pub fn run(dir: &Path, out: &Path, dtype: DType) -> Result<(), String> {
    let report = convert(dir, out, dtype).map_err(|e| format!("convert {}: {e}", dir.display()))?;
    let f = GgufFile::open(out).map_err(|e| format!("re-reading {}: {e}", out.display()))?;
    report.config.validate_tensors(&f).map_err(|e| format!("{}: {e}", out.display()))?;
    println!(
        "wrote {}: {} tensors, {} bytes of tensor data ({dtype} matrices)\n{}",
        out.display(),
        report.n_tensors,
        report.data_bytes,
        report.config
    );
    Ok(())
}
