//! `tessera run` with text: `--prompt` through the file's tokenizer, `--chat`, the streamed text,
//! `--stop`, and the message for a file without a tokenizer. The vocabulary is llama.cpp's
//! qwen35 test vocabulary (the models crate's fixture) on a tiny synthetic model.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn tessera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
}

fn ok(out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A tiny-moe model speaking the fixture vocabulary, and a tiny one with none.
fn models(dir: &Path) -> (PathBuf, PathBuf) {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/data/vocab/ggml-vocab-qwen35.gguf.gz");
    let mut vocab = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(fixture).unwrap()).read_to_end(&mut vocab).unwrap();
    let vocab_path = dir.join("vocab.gguf");
    std::fs::write(&vocab_path, vocab).unwrap();
    let (with, without) = (dir.join("with.gguf"), dir.join("without.gguf"));
    let synth = |out: &Path, vocab: Option<&Path>| {
        let mut c = tessera();
        c.args(["synth", "--preset", "tiny-moe", "--dtype", "f32", "-q", "-o"]).arg(out);
        if let Some(v) = vocab {
            c.arg("--vocab").arg(v);
        }
        ok(c.output().unwrap());
    };
    synth(&with, Some(&vocab_path));
    synth(&without, None);
    (with, without)
}

fn line<'a>(stdout: &'a str, prefix: &str) -> &'a str {
    stdout.lines().find_map(|l| l.strip_prefix(prefix)).unwrap_or_else(|| panic!("no {prefix:?} line in\n{stdout}"))
}

#[test]
fn text_prompts_stream_stop_and_need_a_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (with, without) = models(dir.path());
    let run = |args: &[&str]| tessera().arg("run").arg(&with).args(["--backend", "cpu"]).args(args).output().unwrap();

    // The prompt goes through the file's tokenizer (checked against llama.cpp's ids in
    // models/tests/tokenizer.rs), and the output shows as text.
    let stdout = ok(run(&["--prompt", "Hello, world", "-n", "6"]));
    assert_eq!(line(&stdout, "prompt: "), "9707,11,1879");
    let text = line(&stdout, "text: ").to_string();
    assert!(!text.is_empty(), "{stdout}");

    // --stop ends the text just before the stop string and the generation soon after.
    let stop = &text[text.len() / 2..];
    let stop = stop.get(..stop.len().min(4)).unwrap_or(stop);
    if !stop.trim().is_empty() {
        let stdout = ok(run(&["--prompt", "Hello, world", "-n", "6", "--stop", stop]));
        let cut = line(&stdout, "text: ");
        assert!(!cut.contains(stop) && text.starts_with(cut), "stop {stop:?}: {cut:?} of {text:?}");
    }

    // --chat renders the template (the assistant's turn opened) before encoding.
    let stdout = ok(run(&["--prompt", "Hi", "--chat", "-n", "2"]));
    let ids = line(&stdout, "prompt: ");
    assert!(ids.starts_with("151644,") && ids.ends_with(",151644,77091,198"), "{ids}");

    // Text needs a tokenizer: the message says so and points to --tokens.
    let out = tessera().arg("run").arg(&without).args(["--backend", "cpu", "--prompt", "Hi"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no tokenizer") && err.contains("--tokens"), "{err}");
}

/// `tessera chat`: each stdin line is a turn answered on its own line; the second turn extends
/// what the caches hold (no "feeding the conversation again"), `/reset` starts over, and a file
/// without a tokenizer is refused with the same message as `run --prompt`.
#[test]
fn chat_answers_each_line_and_keeps_the_conversation() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let (with, without) = models(dir.path());
    let mut child = tessera()
        .arg("chat")
        .arg(&with)
        .args(["--backend", "cpu", "-n", "6", "--temperature", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello there\nAnd again\n/reset\nHi\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.lines().count(), 3, "one reply line a turn:\n{stdout}");
    assert!(stderr.contains("(conversation reset)"), "{stderr}");
    assert!(!stderr.contains("feeding the conversation again"), "{stderr}");

    let out = tessera().arg("chat").arg(&without).args(["--backend", "cpu"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tokenizer"));
}
