//! Regression tests of issue 23 (items 1, 4 and 5), run on the `tessera` binary: outputs are
//! atomic and never an input, output paths are checked before any work, the model's context is
//! enforced, a closed stdout is a quiet exit 0, and inputs that are not regular files are clear
//! errors. Every damaged or special input is made here, in a temporary directory.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

fn tessera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
}

/// The hf fixture `name` (config.json + model.safetensors).
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf").join(name)
}

/// A copy of the dense fixture's checkpoint (config.json, model.safetensors) in `dir`.
fn checkpoint_copy(dir: &Path) {
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("qwen35-dense").join(f), dir.join(f)).unwrap();
    }
}

/// The names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits for `child` at most `limit`; kills it and fails the test when it takes longer (a hang).
fn wait_within(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` to completion within `limit` seconds, capturing its output.
fn output_within(cmd: &mut Command, limit_secs: u64, what: &str) -> Output {
    let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Read both pipes on threads so a chatty child cannot block on a full pipe.
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut out_pipe, &mut b).unwrap();
        b
    });
    let err_thread = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut err_pipe, &mut b).unwrap();
        b
    });
    let status = wait_within(&mut child, Duration::from_secs(limit_secs), what);
    Output { status, stdout: out_thread.join().unwrap(), stderr: err_thread.join().unwrap() }
}

/// A tiny f32 model at `path`.
fn synth_tiny(path: &Path, extra: &[&str]) {
    let out =
        tessera().args(["synth", "--preset", "tiny", "--dtype", "f32", "-q"]).args(extra).arg("-o").arg(path).output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}

fn assert_refused(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for n in needles {
        assert!(err.contains(n), "missing {n:?} in {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn convert_refuses_to_overwrite_its_inputs() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint_copy(dir.path());
    let before: Vec<Vec<u8>> =
        ["config.json", "model.safetensors"].iter().map(|f| std::fs::read(dir.path().join(f)).unwrap()).collect();
    for input in ["model.safetensors", "config.json"] {
        let target = dir.path().join(input);
        let out = output_within(
            tessera().args(["convert", "-q", "--dtype", "f32", "--from-hf"]).arg(dir.path()).arg("--out").arg(&target),
            60,
            "convert onto an input",
        );
        assert_refused(&out, &[&target.display().to_string(), "is the input file", input]);
        // The same file by another spelling.
        let other = dir.path().join(".").join(input);
        let out = output_within(
            tessera().args(["convert", "-q", "--from-hf"]).arg(dir.path()).arg("--out").arg(&other),
            60,
            "convert onto an input, another spelling",
        );
        assert_refused(&out, &["is the input file"]);
    }
    let after: Vec<Vec<u8>> =
        ["config.json", "model.safetensors"].iter().map(|f| std::fs::read(dir.path().join(f)).unwrap()).collect();
    assert!(before == after, "the inputs are untouched");
    assert_eq!(names(dir.path()), ["config.json", "model.safetensors"], "no temporary left");
    // The checkpoint directory itself is no output either.
    let out = output_within(
        tessera().args(["convert", "-q", "--from-hf"]).arg(dir.path()).arg("--out").arg(dir.path()),
        60,
        "convert onto its directory",
    );
    assert_refused(&out, &["is a directory"]);
}

#[test]
fn failed_convert_keeps_the_old_output_and_no_temporary() {
    let ckpt = tempfile::tempdir().unwrap();
    checkpoint_copy(ckpt.path());
    // Drop the last layer's down projection: the conversion fails after most tensors are written.
    let bytes = std::fs::read(ckpt.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().filter(|(name, _)| name != "model.layers.7.mlp.down_proj.weight").collect();
    assert_eq!(kept.len() + 1, st.len());
    let damaged = safetensors::tensor::serialize(kept, None).unwrap();
    std::fs::write(ckpt.path().join("model.safetensors"), damaged).unwrap();

    let out_dir = tempfile::tempdir().unwrap();
    let target = out_dir.path().join("model.gguf");
    std::fs::write(&target, b"the previous, good model").unwrap();
    let out = output_within(
        tessera().args(["convert", "-q", "--dtype", "f32", "--from-hf"]).arg(ckpt.path()).arg("--out").arg(&target),
        120,
        "convert of a damaged checkpoint",
    );
    assert_refused(&out, &["model.layers.7.mlp.down_proj.weight"]);
    assert_eq!(std::fs::read(&target).unwrap(), b"the previous, good model", "the old output is untouched");
    assert_eq!(names(out_dir.path()), ["model.gguf"], "no temporary left");
}

#[test]
fn run_refuses_to_dump_logits_onto_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth_tiny(&model, &[]);
    let before = std::fs::read(&model).unwrap();
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&model, &link).unwrap();
    for dump in [&model, &link] {
        let out = output_within(
            tessera()
                .arg("run")
                .arg(&model)
                .args(["--backend", "cpu", "--tokens", "1,2", "-n", "2", "--dump-logits"])
                .arg(dump),
            60,
            "run --dump-logits onto the model",
        );
        assert_refused(&out, &["is the input file", "m.gguf"]);
        assert!(out.stdout.is_empty(), "refused before loading: {}", String::from_utf8_lossy(&out.stdout));
    }
    assert!(std::fs::read(&model).unwrap() == before, "the model is intact");
    assert_eq!(names(dir.path()), ["link.gguf", "m.gguf"]);
}

#[test]
fn dump_logits_into_a_missing_directory_fails_before_generating() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth_tiny(&model, &[]);
    let dump = dir.path().join("missing/dir/logits.safetensors");
    let out = output_within(
        tessera()
            .arg("run")
            .arg(&model)
            .args(["--backend", "cpu", "--tokens", "1,2,3", "-n", "4000", "--dump-logits"])
            .arg(&dump),
        60,
        "run --dump-logits into a missing directory",
    );
    assert_refused(&out, &[&dump.display().to_string(), "does not exist", "missing/dir"]);
    assert!(out.stdout.is_empty(), "nothing loaded or generated: {}", String::from_utf8_lossy(&out.stdout));
    // A directory as the dump path.
    let out = output_within(
        tessera().arg("run").arg(&model).args(["--tokens", "1", "--dump-logits"]).arg(dir.path()),
        60,
        "run --dump-logits onto a directory",
    );
    assert_refused(&out, &["is a directory"]);
}

#[test]
fn synth_to_a_missing_or_bad_directory_fails_fast() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("plain-file");
    std::fs::write(&plain, "x").unwrap();
    // The biggest preset: were the directory checked only at the end, this would run for hours.
    for (target, needle) in [
        (dir.path().join("missing/big.gguf"), "does not exist"),
        (plain.join("big.gguf"), "is not a directory"),
        (PathBuf::from("/dev/null"), "is not a regular file"),
    ] {
        let t0 = Instant::now();
        let out = output_within(
            tessera().args(["synth", "--preset", "qwen35-27b", "--dtype", "q8_0", "-q", "-o"]).arg(&target),
            30,
            "synth to a bad directory",
        );
        assert_refused(&out, &[&target.display().to_string(), needle]);
        assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    }
    assert_eq!(names(dir.path()), ["plain-file"]);
}

#[test]
fn inspect_into_a_closed_pipe_exits_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("many-layers.gguf");
    // Enough tensors that the report is far larger than a pipe's buffer (64 KiB).
    let out = tessera()
        .args(["synth", "--preset", "tiny", "--dtype", "q8_0", "-q", "--set", "block_count=160", "-o"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let mut child = tessera().arg("inspect").arg(&model).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("file: "), "{first}");
    // The reader (dropped above) is gone, like `head -1`.
    let status = wait_within(&mut child, Duration::from_secs(30), "inspect | head -1");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "stderr: {err}");
    assert!(err.is_empty(), "quiet: {err}");
}

#[test]
fn non_regular_inputs_are_clear_errors_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for cmd in [&["inspect"][..], &["run", "--tokens", "1"][..]] {
        let what = format!("{} on a FIFO", cmd[0]);
        let out = output_within(tessera().arg(cmd[0]).arg(&fifo).args(&cmd[1..]), 20, &what);
        assert_refused(&out, &[&fifo.display().to_string(), "is not a regular file", "FIFO"]);
        let what = format!("{} on a directory", cmd[0]);
        let out = output_within(tessera().arg(cmd[0]).arg(dir.path()).args(&cmd[1..]), 20, &what);
        assert_refused(&out, &[&dir.path().display().to_string(), "is a directory"]);
        assert!(!stderr(&out).contains("No such device"), "{}", stderr(&out));
    }
    // A checkpoint whose config.json or weights are FIFOs.
    let ckpt = tempfile::tempdir().unwrap();
    checkpoint_copy(ckpt.path());
    for name in ["model.safetensors", "config.json"] {
        let f = ckpt.path().join(name);
        std::fs::remove_file(&f).unwrap();
        assert!(Command::new("mkfifo").arg(&f).status().unwrap().success());
        let out = output_within(
            tessera().args(["convert", "-q", "--from-hf"]).arg(ckpt.path()).arg("--out").arg(dir.path().join("o.gguf")),
            20,
            "convert with a FIFO in the checkpoint",
        );
        assert_refused(&out, &[&f.display().to_string(), "is not a regular file"]);
    }
}

#[test]
fn prompt_plus_new_tokens_must_fit_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth_tiny(&model, &[]);
    // tiny's context is 4096 tokens.
    let out = output_within(
        tessera().arg("run").arg(&model).args(["--backend", "cpu", "--tokens", "1,2,3", "-n", "5000"]),
        60,
        "run past the context",
    );
    assert_refused(&out, &["sequence 0", "3 tokens", "-n 5000", "5003", "context length of 4096", "m.gguf"]);
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    let out = output_within(
        tessera()
            .arg("run")
            .arg(&model)
            .args(["--backend", "cpu", "--tokens", "1", "--tokens", "1,2,3", "-n"])
            .arg(u64::MAX.to_string()),
        60,
        "run with -n u64::MAX",
    );
    assert_refused(&out, &["too many tokens", &format!("-n {}", u64::MAX), "context length of 4096"]);
    assert!(!stderr(&out).contains("overflow"), "{}", stderr(&out));
    // Within the context it runs.
    let out = output_within(
        tessera().arg("run").arg(&model).args(["--backend", "cpu", "--tokens", "1,2,3", "-n", "1"]),
        60,
        "run within the context",
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Starts `synth` of a large model over an existing file, sends `signal` once the temporary file
/// is being written, and checks the exit status, the old file and that no temporary remains.
fn interrupted_synth(signal: &str, code: i32) {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("model.gguf");
    std::fs::write(&target, b"the previous model").unwrap();
    let mut child = tessera()
        // 4 of the 27B's layers: about 4.5 GB if it ran to the end, which takes a while.
        .args(["synth", "--preset", "qwen35-27b", "--dtype", "q8_0", "--set", "block_count=4", "-q", "-o"])
        .arg(&target)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the temporary to have data in it.
    let t0 = Instant::now();
    loop {
        let writing = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap())
            .any(|e| e.file_name() != "model.gguf" && e.metadata().map(|m| m.len() > 0).unwrap_or(false));
        if writing {
            break;
        }
        if t0.elapsed() > Duration::from_secs(60) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            panic!("synth never started writing: {:?}", child.wait());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let sent = Command::new("kill").arg(format!("-{signal}")).arg(child.id().to_string()).status().unwrap();
    assert!(sent.success());
    let status = wait_within(&mut child, Duration::from_secs(30), "interrupted synth");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(code), "{err}");
    assert!(err.contains(&format!("interrupted by SIG{signal}")), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"the previous model", "the old file is untouched");
    assert_eq!(names(dir.path()), ["model.gguf"], "no temporary left");
}

#[test]
fn sigint_during_synth_keeps_the_old_file_and_removes_the_temporary() {
    interrupted_synth("INT", 130);
}

#[test]
fn sigterm_during_synth_keeps_the_old_file_and_removes_the_temporary() {
    interrupted_synth("TERM", 143);
}
