//! `GgufWriter::write_file` / `write_file_with` write atomically (issue 23, item 1): a failure
//! while streaming tensors leaves an existing file byte for byte and no temporary beside it.

use std::io;

use tessera_models::gguf::{GgufFile, GgufWriter};
use tessera_ops::DType;

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary() {
    let dir = std::env::temp_dir().join(format!("tessera_gguf_atomic_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "qwen35").unwrap();
    for i in 0..4 {
        w.add_tensor_info(format!("t{i}"), DType::F32, &[1 << 16]).unwrap();
    }
    let fill_all = |_: &str, out: &mut dyn io::Write| out.write_all(&vec![0u8; 4 << 16]);
    w.write_file_with(&path, fill_all).unwrap();
    let good = std::fs::read(&path).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap().tensors().len(), 4);

    // The third tensor fails after the first two (and part of the third) were written.
    let mut n = 0;
    let e = w
        .write_file_with(&path, |_, out| {
            n += 1;
            out.write_all(&vec![1u8; 1 << 16])?;
            if n == 3 { Err(io::Error::other("disk full")) } else { out.write_all(&vec![1u8; 3 << 16]) }
        })
        .unwrap_err();
    assert!(e.to_string().contains("disk full"), "{e}");
    assert!(std::fs::read(&path).unwrap() == good, "the old file is untouched");
    assert_eq!(names(&dir), ["m.gguf"], "no temporary left");

    // A short tensor is an error too, with the same guarantees.
    let e = w.write_file_with(&path, |_, out| out.write_all(&[1u8; 8])).unwrap_err();
    assert!(e.to_string().contains("t0"), "{e}");
    assert!(std::fs::read(&path).unwrap() == good);
    assert_eq!(names(&dir), ["m.gguf"]);

    // A directory or a missing directory is refused before anything is written.
    let e = w.write_file_with(&dir, fill_all).unwrap_err();
    assert!(e.to_string().contains("is a directory"), "{e}");
    let e = w.write_file_with(dir.join("missing/m.gguf"), fill_all).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
