//! Runs the `tessera` binary end to end.

use std::process::Command;

fn tessera() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera"))
}

#[test]
fn synth_then_inspect() {
    let path = std::env::temp_dir().join(format!("tessera_cli_{}.gguf", std::process::id()));
    let out = tessera()
        .args(["synth", "--preset", "tiny", "--dtype", "q8_0", "--seed", "2", "--set", "block_count=6", "-q", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("wrote"));

    let out = tessera().arg("inspect").arg(&path).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "architecture: qwen35",
        "qwen35.block_count",
        "qwen35.rope.dimension_sections",
        "[3, 3, 2, 0]",
        "blk.5.attn_q.weight",
        "q8_0",
        "arch qwen35: 6 layers (3 full attention, 3 gated DeltaNet)",
        "tensors: ok",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn inspect_garbage_fails_with_a_message() {
    let path = std::env::temp_dir().join(format!("tessera_cli_garbage_{}.gguf", std::process::id()));
    std::fs::write(&path, b"this is not a gguf file at all").unwrap();
    let out = tessera().arg("inspect").arg(&path).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error: not a GGUF file"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_file(path).unwrap();

    let out = tessera().args(["inspect", "/nonexistent/tessera.gguf"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("error:"));
}

#[test]
fn synth_rejects_bad_preset_and_override() {
    let path = std::env::temp_dir().join(format!("tessera_cli_bad_{}.gguf", std::process::id()));
    let out = tessera().args(["synth", "--preset", "huge", "-o"]).arg(&path).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown preset `huge`"));
    let out = tessera()
        .args(["synth", "--preset", "tiny", "--set", "attention.head_count_kv=3", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen35.attention.head_count_kv"));
    let out = tessera()
        .args(["synth", "--preset", "tiny", "--dtype", "nvfp4", "--set", "feed_forward_length=96", "-o"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("blk.0.ffn_down.weight"));
    assert!(!path.exists(), "no file is written on a config error");
}
