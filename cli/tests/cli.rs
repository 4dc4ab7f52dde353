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

#[test]
fn demo_runs_and_self_checks() {
    let out = tessera().arg("demo").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for line in [
        "backend: cpu (no other backend built; nothing to check against the CPU oracle)",
        "arch qwen35moe: 4 layers",
        "memory: weights ",
        "memory: kv cache per token ",
        "memory: recurrent state per sequence ",
        "batched run: 3 sequences, prompts of [5, 23, 61] tokens",
        "fed prompt chunks beside decode tokens",
        "seq 2: prompt 61 tokens -> ",
        "tokens generated: 36 in ",
        "prefill: 89 tokens in ",
        "caches after the run: 0 kv blocks, 0 recurrent slots in use",
        "self-check: batched tokens equal each sequence run alone: ok",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
}

#[test]
fn run_generates_from_token_ids() {
    let path = std::env::temp_dir().join(format!("tessera_cli_run_{}.gguf", std::process::id()));
    let out = tessera().args(["synth", "--preset", "tiny", "--dtype", "f32", "-q", "-o"]).arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let run = |extra: &[&str]| {
        let out = tessera().arg("run").arg(&path).args(["--tokens", "1,2,3", "-n", "5"]).args(extra).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    let stdout = run(&[]);
    for line in [
        "backend: cpu (CUDA comes in a later issue)",
        "memory: weights ",
        "memory: kv cache per token ",
        "memory: recurrent state per sequence ",
        "prompt: 1,2,3",
        "prefill: 3 tokens in ",
        "decode: 4 tokens in ",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in\n{stdout}");
    }
    let generated = |s: &str| s.lines().find(|l| l.starts_with("generated: ")).map(str::to_owned).unwrap();
    assert_eq!(generated(&stdout).trim_start_matches("generated: ").split(',').count(), 5);
    let sampled = ["--seed", "3", "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9"];
    assert_eq!(generated(&run(&sampled)), generated(&run(&sampled)), "same seed, same tokens");

    let out = tessera().arg("run").arg(&path).args(["--tokens", "1", "--top-p", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("top_p must be in (0, 1]"));
    let out = tessera().arg("run").arg(&path).args(["--tokens", "1,999"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside the vocab"));
    std::fs::remove_file(path).unwrap();
}

#[test]
fn run_missing_file_fails_with_a_message() {
    let out = tessera().args(["run", "/nonexistent/tessera.gguf", "--tokens", "1,2"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error:") && stderr.contains("/nonexistent/tessera.gguf"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
