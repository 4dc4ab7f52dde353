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
    assert!(stderr.contains(&format!("error: {}: not a GGUF file", path.display())), "{stderr}");
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
    // The best backend present: the CPU here, CUDA on a GPU machine (then checked against the CPU).
    assert!(
        stdout.contains("oracle check: skipped") || stdout.contains("oracle check: cuda tokens identical"),
        "{stdout}"
    );
    for line in [
        "backend: ",
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
        let out = tessera()
            .arg("run")
            .arg(&path)
            .args(["--backend", "cpu", "--tokens", "1,2,3", "-n", "5"])
            .args(extra)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
    };
    let stdout = run(&[]);
    for line in [
        "backend: cpu (",
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

/// `convert` a transformers fixture, `run --dump-logits` two sequences batched, read the dump
/// back: the ids are the prompts plus the fed greedy tokens, and the logits match both the
/// transformers reference and the model's own logits for each sequence run alone in one pass.
#[test]
fn run_dumps_logits_of_every_position() {
    use safetensors::{Dtype, SafeTensors};
    use tessera_cpu::CpuBackend;
    use tessera_models::gguf::GgufFile;
    use tessera_models::model::{Logits, Model, ModelOptions};
    use tessera_ops::DType;

    fn ids(st: &SafeTensors<'_>, name: &str) -> Vec<u32> {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::I32, "{name}");
        t.data().chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect()
    }
    fn f32s(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }
    let join = |t: &[u32]| t.iter().map(u32::to_string).collect::<Vec<_>>().join(",");

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hf/qwen35-dense");
    let ref_bytes = std::fs::read(fixture.join("reference.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&ref_bytes).unwrap();
    let (prompt, cont, extra) =
        (ids(&reference, "prompt.ids"), ids(&reference, "continuation.ids"), ids(&reference, "extra1.ids"));
    let dir = std::env::temp_dir().join(format!("tessera_cli_dump_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (gguf, dump) = (dir.join("m.gguf"), dir.join("logits.safetensors"));

    let out = tessera()
        .args(["convert", "--dtype", "f32", "-q", "--from-hf"])
        .arg(&fixture)
        .arg("--out")
        .arg(&gguf)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "quiet convert: {}", String::from_utf8_lossy(&out.stderr));

    let n_new = cont.len() + 1;
    let out = tessera()
        .arg("run")
        .arg(&gguf)
        .args(["--tokens", &join(&prompt), "--tokens", &join(&extra), "-n", &n_new.to_string()])
        .args(["--kv-dtype", "f32", "--max-tokens-per-step", "16", "--dump-logits"])
        .arg(&dump)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains(&format!("seq0 prompt: {}", join(&prompt))), "{stdout}");
    assert!(stdout.contains("dumped logits of 2 sequence(s) ([56, 23] x 512 f32)"), "{stdout}");

    let bytes = std::fs::read(&dump).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names, ["seq0.ids", "seq0.logits", "seq1.ids", "seq1.logits"]);
    let file = GgufFile::open(&gguf).unwrap();
    let mut be = CpuBackend::new();
    for (k, (p, ref_name)) in [(&prompt, "full.logits"), (&extra, "extra1.logits")].into_iter().enumerate() {
        let fed = ids(&st, &format!("seq{k}.ids"));
        assert_eq!(fed.len(), p.len() + n_new - 1, "seq{k}: prompt + every generated token but the last");
        assert_eq!(fed[..p.len()], p[..], "seq{k}");
        let (shape, got) = f32s(&st, &format!("seq{k}.logits"));
        assert_eq!(shape, [fed.len(), 512], "seq{k}");
        if k == 0 {
            assert_eq!(fed[p.len()..], cont[..], "greedy continuation");
        }
        // Against transformers: every position of prompt + continuation, or the extra prompt's.
        let (_, want) = f32s(&reference, ref_name);
        let d_ref = max_abs_diff(&got[..want.len()], &want);
        // Against the model: the dumped ids in one pass, alone.
        let opts = ModelOptions { kv_dtype: DType::F32, n_slots: 1, ..ModelOptions::default() };
        let mut m = Model::load(&file, &mut be, opts).unwrap();
        let alone = m.step(&mut be, &[(0, &fed)], Logits::All).unwrap().remove(0);
        m.free(&mut be);
        let d_model = max_abs_diff(&got, &alone);
        eprintln!("seq{k}: dumped logits vs transformers max |diff| {d_ref:e}, vs the model alone {d_model:e}");
        assert!(d_ref <= 1e-3, "seq{k}: dumped logits differ from transformers by {d_ref}");
        assert!(d_model <= 1e-4, "seq{k}: dumped logits differ from the model alone by {d_model}");
    }
    drop(file);

    // An unwritable dump path is an error message, not a panic.
    let out = tessera()
        .arg("run")
        .arg(&gguf)
        .args(["--tokens", "1,2", "-n", "1", "--dump-logits", "/nonexistent/dir/l.safetensors"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error: /nonexistent/dir/l.safetensors") && !stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn convert_quiet_and_missing_dir() {
    let out =
        tessera().args(["convert", "--from-hf", "/nonexistent/ckpt", "--out", "/tmp/x.gguf", "-q"]).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error: convert /nonexistent/ckpt") && !stderr.contains("panicked"), "{stderr}");
}
