//! `tessera convert --from-hf DIR --out FILE [--dtype f32|f16|bf16|q8_0|nvfp4] [--allow-nonfinite] [-q]`.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tessera_models::convert::{ConvertOptions, ConvertProgress, convert_with_options};
use tessera_models::gguf::GgufFile;
use tessera_ops::DType;

/// Converts the HF Qwen3.5 checkpoint in `dir` to `out` as `opts` says, re-opens it and checks its
/// tensors against the config, then prints the warnings (stderr) and a summary. A progress bar
/// over the tensor bytes is drawn on stderr when it is a terminal and `quiet` is off.
pub fn run(dir: &Path, out: &Path, opts: &ConvertOptions, quiet: bool) -> Result<(), String> {
    let dtype: DType = opts.dtype;
    // Hidden until the first report, when the total is known (so it never flashes full or empty).
    let draw = !quiet && std::io::stderr().is_terminal();
    let bar = ProgressBar::hidden();
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:24}] {bytes}/{total_bytes} ({prefix} tensors) eta {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    bar.set_message(format!("convert to {dtype}"));
    let mut on_progress = |p: ConvertProgress| {
        bar.set_length(p.total_bytes);
        bar.set_position(p.bytes_written);
        bar.set_prefix(format!("{}/{}", p.tensors_done, p.n_tensors));
        if draw && p.tensors_done == 0 {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    };
    let result = convert_with_options(dir, out, opts, Some(&mut on_progress));
    bar.finish_and_clear();
    let report = result.map_err(|e| format!("convert {}: {e}", dir.display()))?;
    for w in &report.warnings {
        eprintln!("warning: {w}");
    }
    let f = GgufFile::open(out).map_err(|e| format!("re-reading {}: {e}", out.display()))?;
    report.config.validate_tensors(&f).map_err(|e| format!("{}: {e}", out.display()))?;
    let vocab = match report.vocab_tokens {
        Some(n) => format!("a vocabulary of {n} tokens"),
        None => "no vocabulary (the checkpoint has no tokenizer.json)".to_string(),
    };
    outln!(
        "wrote {}: {} tensors, {} bytes of tensor data ({dtype} matrices), {vocab}\n{}",
        out.display(),
        report.n_tensors,
        report.data_bytes,
        report.config
    );
    Ok(())
}
