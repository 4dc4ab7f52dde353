//! GGUF round trips: writer -> reader with every value type and every dtype, alignment, the
//! streaming writer, a hand-assembled file, and the getters' errors.

use tessera_models::gguf::{Array, GgufError, GgufFile, GgufWriter, Value, ValueType};
use tessera_ops::DType;

/// Deterministic pseudo-random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// Every value type, including nested, empty and string arrays and empty strings.
fn all_values() -> Vec<(String, Value)> {
    let nested = Array::Array(vec![
        Array::I16(vec![-1, 2, 3]),
        Array::String(vec!["x".into(), String::new()]),
        Array::Array(vec![Array::U8(vec![7]), Array::Array(vec![])]),
        Array::F64(vec![]),
    ]);
    let v: Vec<(&str, Value)> = vec![
        ("general.architecture", "qwen35".into()),
        ("t.u8", 250u8.into()),
        ("t.i8", (-5i8).into()),
        ("t.u16", 65_000u16.into()),
        ("t.i16", (-30_000i16).into()),
        ("t.u32", 4_000_000_000u32.into()),
        ("t.i32", (-2_000_000_000i32).into()),
        ("t.f32", 1.5e-6f32.into()),
        ("t.bool_true", true.into()),
        ("t.bool_false", false.into()),
        ("t.string", "héllo wörld ✓".into()),
        ("t.empty_string", "".into()),
        ("t.u64", u64::MAX.into()),
        ("t.i64", i64::MIN.into()),
        ("t.f64", std::f64::consts::PI.into()),
        ("t.arr_u8", vec![0u8, 1, 255].into()),
        ("t.arr_i8", vec![-128i8, 127].into()),
        ("t.arr_u16", vec![1u16, 65535].into()),
        ("t.arr_i16", vec![-1i16].into()),
        ("t.arr_u32", vec![1u32, 2, 3].into()),
        ("t.arr_i32", vec![-1i32, 0, 1].into()),
        ("t.arr_f32", vec![0.5f32, -0.0, f32::INFINITY].into()),
        ("t.arr_bool", vec![true, false, true].into()),
        ("t.arr_string", vec!["a", "", "ccc"].into()),
        ("t.arr_u64", vec![u64::MAX, 0].into()),
        ("t.arr_i64", vec![i64::MIN, i64::MAX].into()),
        ("t.arr_f64", vec![1e300f64, -1e-300].into()),
        ("t.arr_empty_u32", Array::empty(ValueType::U32).into()),
        ("t.arr_empty_string", Array::empty(ValueType::String).into()),
        ("t.arr_empty_array", Array::empty(ValueType::Array).into()),
        ("t.nested", nested.into()),
        ("", "empty key".into()),
    ];
    v.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// A tensor to write: name, dtype, dims (ggml order) and bytes.
type TensorCase = (String, DType, Vec<usize>, Vec<u8>);

/// Several tensors of every dtype (rows of whole blocks), with their bytes.
fn all_tensors() -> Vec<TensorCase> {
    let shapes: [&[usize]; 3] = [&[64], &[128, 3], &[64, 2, 3, 2]];
    let mut out = Vec::new();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        for (j, dims) in shapes.iter().enumerate() {
            let rows: usize = dims[1..].iter().product();
            let size = dtype.row_bytes(dims[0]).unwrap() * rows;
            out.push((format!("blk.{j}.{dtype}.weight"), dtype, dims.to_vec(), bytes(size, (i * 10 + j) as u64)));
        }
    }
    // Odd sizes so padding is exercised.
    out.push(("odd.f16".into(), DType::F16, vec![3], bytes(6, 99)));
    out.push(("odd.f32".into(), DType::F32, vec![1, 1, 1, 1], bytes(4, 98)));
    out
}

fn build(alignment: Option<u32>) -> (GgufWriter, Vec<(String, Value)>, Vec<TensorCase>) {
    let mut w = GgufWriter::new();
    let mut kvs = all_values();
    if let Some(a) = alignment {
        w.set_alignment(a).unwrap();
        kvs.insert(0, ("general.alignment".into(), Value::U32(a)));
    }
    for (k, v) in all_values() {
        w.add_kv(k, v).unwrap();
    }
    let tensors = all_tensors();
    for (name, dtype, dims, data) in &tensors {
        w.add_tensor(name.clone(), *dtype, dims, data.clone()).unwrap();
    }
    (w, kvs, tensors)
}

fn check_round_trip(alignment: Option<u32>) {
    let (w, kvs, tensors) = build(alignment);
    let file_bytes = w.to_bytes().unwrap();
    let f = GgufFile::from_bytes(file_bytes.clone()).unwrap();
    let align = alignment.unwrap_or(32) as usize;
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), align);
    assert_eq!(f.metadata(), &kvs[..]);
    for (k, v) in &kvs {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.data_offset() % align, 0);
    assert_eq!(file_bytes.len() % align, 0, "the last tensor is padded too");
    assert_eq!(f.tensors().len(), tensors.len());
    for (info, (name, dtype, dims, data)) in f.tensors().iter().zip(&tensors) {
        assert_eq!(&info.name, name);
        assert_eq!(info.dtype, *dtype);
        assert_eq!(info.dims(), &dims[..]);
        assert_eq!(info.ne.len(), 4);
        assert!(info.ne[dims.len()..].iter().all(|&n| n == 1));
        assert_eq!(info.size, data.len());
        assert_eq!(info.offset % align as u64, 0, "{name} offset aligned");
        assert_eq!((f.data_offset() + info.offset as usize) % align, 0);
        assert_eq!(f.tensor_data(name).unwrap(), &data[..], "{name} bytes");
    }
    // Padding bytes are zeros and the layout is back to back like llama.cpp's.
    let mut next = 0u64;
    for info in f.tensors() {
        assert_eq!(info.offset, next);
        next += (info.size as u64).next_multiple_of(align as u64);
        let start = f.data_offset() + info.offset as usize + info.size;
        let end = f.data_offset() + next as usize;
        assert!(file_bytes[start..end].iter().all(|&b| b == 0));
    }
    // Deterministic, and a re-encode of what was read is byte-identical.
    assert_eq!(w.to_bytes().unwrap(), file_bytes);
    assert_eq!(GgufWriter::from_file(&f).unwrap().to_bytes().unwrap(), file_bytes);
}

#[test]
fn round_trip_every_value_type_and_dtype_default_alignment() {
    check_round_trip(None);
}

#[test]
fn round_trip_custom_alignment_64() {
    check_round_trip(Some(64));
}

#[test]
fn round_trip_small_alignments() {
    check_round_trip(Some(1));
    check_round_trip(Some(8));
}

#[test]
fn nan_and_negative_zero_survive_bit_for_bit() {
    let mut w = GgufWriter::new();
    w.add_kv("nan32", f32::from_bits(0x7fc0_1234)).unwrap();
    w.add_kv("nan64", f64::from_bits(0x7ff8_0000_0000_beef)).unwrap();
    w.add_kv("negzero", -0.0f32).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_f32("nan32").unwrap().to_bits(), 0x7fc0_1234);
    assert_eq!(f.get_f64("nan64").unwrap().to_bits(), 0x7ff8_0000_0000_beef);
    assert_eq!(f.get_f32("negzero").unwrap().to_bits(), (-0.0f32).to_bits());
}

#[test]
fn streaming_writer_matches_in_memory_writer() {
    let (w, _, tensors) = build(Some(64));
    let expected = w.to_bytes().unwrap();
    let mut s = GgufWriter::new();
    s.set_alignment(64).unwrap();
    for (k, v) in all_values() {
        s.add_kv(k, v).unwrap();
    }
    // Alternate in-memory and streamed tensors.
    for (i, (name, dtype, dims, data)) in tensors.iter().enumerate() {
        if i % 2 == 0 {
            s.add_tensor_info(name.clone(), *dtype, dims).unwrap();
        } else {
            s.add_tensor(name.clone(), *dtype, dims, data.clone()).unwrap();
        }
    }
    assert!(matches!(s.to_bytes(), Err(GgufError::MissingTensor { .. })), "in-memory write needs every tensor's bytes");
    let mut asked = Vec::new();
    let mut out = Vec::new();
    s.write_with(&mut out, |name, w| {
        asked.push(name.to_string());
        let data = &tensors.iter().find(|t| t.0 == name).unwrap().3;
        // Write in two pieces, as a generator would.
        w.write_all(&data[..data.len() / 2])?;
        w.write_all(&data[data.len() / 2..])
    })
    .unwrap();
    assert_eq!(out, expected);
    let streamed: Vec<_> = tensors.iter().step_by(2).map(|t| t.0.clone()).collect();
    assert_eq!(asked, streamed, "asked in order, only for streamed tensors");

    // A callback that writes the wrong number of bytes is an error naming the tensor.
    let err = s.write_with(Vec::new(), |_, w| w.write_all(&[0u8; 3])).unwrap_err();
    assert!(matches!(&err, GgufError::SizeMismatch { name, got: 3, .. } if name == &tensors[0].0), "{err}");
}

#[test]
fn write_file_and_open_with_mmap() {
    let (w, kvs, tensors) = build(None);
    let path = std::env::temp_dir().join(format!("tessera_gguf_roundtrip_{}.gguf", std::process::id()));
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.metadata(), &kvs[..]);
    for (name, _, _, data) in &tensors {
        assert_eq!(f.tensor_data(name).unwrap(), &data[..]);
        let ptr = f.tensor_data(name).unwrap().as_ptr() as usize;
        assert_eq!(ptr % 32, 0, "mmapped tensor data is aligned in memory");
    }
    drop(f);
    std::fs::remove_file(&path).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, GgufError::File { .. }) && err.to_string().contains("tessera_gguf_roundtrip"), "{err}");
}

/// A minimal file assembled byte by byte from the spec (not with the writer), so writer and reader
/// cannot share a misunderstanding: one u32 kv, one string kv, one array kv, and one 2x2 f32 tensor.
fn hand_assembled() -> Vec<u8> {
    let mut b: Vec<u8> = Vec::new();
    b.extend(b"GGUF"); // magic: 47 47 55 46
    b.extend([3, 0, 0, 0]); // version 3
    b.extend([1, 0, 0, 0, 0, 0, 0, 0]); // tensor_count = 1
    b.extend([3, 0, 0, 0, 0, 0, 0, 0]); // metadata_kv_count = 3
    // kv 0: "general.alignment" = u32 32
    b.extend([17, 0, 0, 0, 0, 0, 0, 0]);
    b.extend(b"general.alignment");
    b.extend([4, 0, 0, 0]); // type u32
    b.extend([32, 0, 0, 0]);
    // kv 1: "a.name" = string "hi"
    b.extend([6, 0, 0, 0, 0, 0, 0, 0]);
    b.extend(b"a.name");
    b.extend([8, 0, 0, 0]); // type string
    b.extend([2, 0, 0, 0, 0, 0, 0, 0]);
    b.extend(b"hi");
    // kv 2: "a.list" = array of i32 [-1, 258]
    b.extend([6, 0, 0, 0, 0, 0, 0, 0]);
    b.extend(b"a.list");
    b.extend([9, 0, 0, 0]); // type array
    b.extend([5, 0, 0, 0]); // element type i32
    b.extend([2, 0, 0, 0, 0, 0, 0, 0]); // 2 elements
    b.extend([0xff, 0xff, 0xff, 0xff]); // -1
    b.extend([2, 1, 0, 0]); // 258
    // tensor info: "w", n_dims 2, ne = [2, 2], type f32 (0), offset 0
    b.extend([1, 0, 0, 0, 0, 0, 0, 0]);
    b.extend(b"w");
    b.extend([2, 0, 0, 0]);
    b.extend([2, 0, 0, 0, 0, 0, 0, 0]);
    b.extend([2, 0, 0, 0, 0, 0, 0, 0]);
    b.extend([0, 0, 0, 0]);
    b.extend([0, 0, 0, 0, 0, 0, 0, 0]);
    // Header so far: 4+4+8+8 + (8+17+4+4) + (8+6+4+8+2) + (8+6+4+4+8+8) + (8+1+4+16+4+8) = 164 bytes.
    assert_eq!(b.len(), 164);
    b.extend([0u8; 28]); // padding to 192, the next multiple of 32
    for x in [1.0f32, 2.0, 3.0, 4.0] {
        b.extend(x.to_le_bytes());
    }
    b.extend([0u8; 16]); // the tensor's 16 bytes padded to 32, as llama.cpp writes it
    b
}

#[test]
fn hand_assembled_minimal_file_parses() {
    let b = hand_assembled();
    let f = GgufFile::from_bytes(b.clone()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_offset(), 192);
    assert_eq!(f.get_u32("general.alignment").unwrap(), 32);
    assert_eq!(f.get_str("a.name").unwrap(), "hi");
    assert_eq!(f.get_i32_array("a.list").unwrap(), [-1, 258]);
    let t = &f.tensors()[0];
    assert_eq!((t.name.as_str(), t.dtype, t.n_dims, t.ne, t.offset, t.size), ("w", DType::F32, 2, [2, 2, 1, 1], 0, 16));
    let data: Vec<f32> =
        f.tensor_data("w").unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(data, [1.0, 2.0, 3.0, 4.0]);
    // The writer produces exactly these bytes from the same content.
    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", 32u32).unwrap();
    w.add_kv("a.name", "hi").unwrap();
    w.add_kv("a.list", vec![-1i32, 258]).unwrap();
    w.add_tensor("w", DType::F32, &[2, 2], b[192..208].to_vec()).unwrap();
    assert_eq!(w.to_bytes().unwrap(), b);
    assert_eq!(GgufWriter::from_file(&f).unwrap().to_bytes().unwrap(), b);
    // Version 2 has the same layout and is read too; the data need not be padded at the end.
    let mut v2 = b.clone();
    v2[4] = 2;
    v2.truncate(208);
    assert_eq!(GgufFile::from_bytes(v2).unwrap().version(), 2);
}

#[test]
fn getters_check_types_and_name_the_key() {
    let mut w = GgufWriter::new();
    w.add_kv("n_u32", 7u32).unwrap();
    w.add_kv("n_i32", 9i32).unwrap();
    w.add_kv("n_u64", 11u64).unwrap();
    w.add_kv("n_neg", -3i64).unwrap();
    w.add_kv("n_u8", 5u8).unwrap();
    w.add_kv("eps", 1e-6f32).unwrap();
    w.add_kv("eps64", 0.25f64).unwrap();
    w.add_kv("sections", vec![11i32, 11, 10, 0]).unwrap();
    w.add_kv("bad_sections", vec![1i32, -1]).unwrap();
    w.add_kv("name", "x").unwrap();
    w.add_kv("nested", Array::Array(vec![Array::U32(vec![1])])).unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();

    assert_eq!(f.get_u32("n_u32").unwrap(), 7);
    let err = f.get_u32("n_i32").unwrap_err();
    assert!(
        matches!(&err, GgufError::WrongType { key, expected: "u32", found } if key == "n_i32" && found == "i32"),
        "{err}"
    );
    assert!(err.to_string().contains("n_i32"));
    for (k, v) in [("n_u32", 7), ("n_i32", 9), ("n_u64", 11), ("n_u8", 5)] {
        assert_eq!(f.get_usize(k).unwrap(), v, "{k}");
    }
    assert!(matches!(f.get_usize("n_neg"), Err(GgufError::OutOfRange { key, .. }) if key == "n_neg"));
    assert_eq!(f.get_int("n_neg").unwrap(), -3);
    assert!(matches!(f.get_usize("eps"), Err(GgufError::WrongType { expected: "integer", .. })));
    assert_eq!(f.get_usize_opt("absent").unwrap(), None);
    assert_eq!(f.get_usize_opt("n_u64").unwrap(), Some(11));
    assert_eq!(f.get_float("eps").unwrap(), 1e-6f32 as f64);
    assert_eq!(f.get_float("eps64").unwrap(), 0.25);
    assert_eq!(f.get_float_opt("absent").unwrap(), None);
    assert_eq!(f.get_usize_array("sections").unwrap(), [11, 11, 10, 0]);
    assert!(matches!(f.get_usize_array("bad_sections"), Err(GgufError::OutOfRange { .. })));
    assert!(matches!(f.get_usize_array("name"), Err(GgufError::WrongType { .. })));
    let err = f.get_str_array("sections").unwrap_err();
    assert!(err.to_string().contains("array of i32") && err.to_string().contains("array of string"), "{err}");
    assert_eq!(f.get_array_of::<Array>("nested").unwrap(), [Array::U32(vec![1])]);
    assert_eq!(f.get_array("sections").unwrap().len(), 4);
    let err = f.get_str("missing.key").unwrap_err();
    assert!(matches!(&err, GgufError::MissingKey { key } if key == "missing.key"), "{err}");
    assert!(matches!(f.tensor_data("nope"), Err(GgufError::MissingTensor { name }) if name == "nope"));
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    w.add_kv("k", 1u8).unwrap();
    assert!(matches!(w.add_kv("k", 2u8), Err(GgufError::DuplicateKey { key }) if key == "k"));
    assert!(matches!(w.add_kv("general.alignment", 3u32), Err(GgufError::BadAlignment { value: 3 })));
    assert!(matches!(w.add_kv("general.alignment", 0u32), Err(GgufError::BadAlignment { value: 0 })));
    assert!(matches!(w.add_kv("general.alignment", 32u64), Err(GgufError::WrongType { .. })));
    assert!(matches!(w.set_alignment(48), Err(GgufError::BadAlignment { value: 48 })));
    let mut deep = Array::U8(vec![1]);
    for _ in 0..8 {
        deep = Array::Array(vec![deep]);
    }
    assert!(matches!(w.add_kv("deep", deep), Err(GgufError::NestingTooDeep { .. })));
    w.add_tensor("t", DType::F32, &[2], vec![0u8; 8]).unwrap();
    assert!(matches!(w.add_tensor("t", DType::F32, &[2], vec![0u8; 8]), Err(GgufError::DuplicateTensor { .. })));
    let e = w.add_tensor("s", DType::F32, &[3], vec![0u8; 8]).unwrap_err();
    assert!(matches!(&e, GgufError::SizeMismatch { expected: 12, got: 8, .. }), "{e}");
    for dims in [&[][..], &[0], &[1, 2, 3, 4, 5], &[usize::MAX, 2]] {
        assert!(matches!(w.add_tensor_info("d", DType::F32, dims), Err(GgufError::BadDims { .. })), "{dims:?}");
    }
    let e = w.add_tensor_info("q", DType::Q8_0, &[33]).unwrap_err();
    assert!(e.to_string().contains("whole number of q8_0 blocks"), "{e}");
    // set_alignment replaces in place.
    w.set_alignment(64).unwrap();
    w.set_alignment(16).unwrap();
    assert_eq!(w.alignment(), 16);
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.alignment(), 16);
    assert_eq!(f.metadata().iter().filter(|(k, _)| k == "general.alignment").count(), 1);
}

#[test]
fn file_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<GgufWriter>();
}

/// A tokenizer-sized string array and a model-sized tensor list parse quickly and exactly.
#[test]
fn large_vocab_and_many_tensors() {
    let mut w = GgufWriter::new();
    let tokens: Vec<String> = (0..150_000).map(|i| format!("tok{i}")).collect();
    w.add_kv("tokenizer.ggml.tokens", Value::Array(Array::String(tokens.clone()))).unwrap();
    w.add_kv("tokenizer.ggml.token_type", vec![1i32; 150_000]).unwrap();
    for i in 0..2_000 {
        w.add_tensor_info(format!("blk.{i}.w"), DType::Q8_0, &[64, 2]).unwrap();
    }
    let mut out = Vec::new();
    w.write_with(&mut out, |name, w| w.write_all(&bytes(136, name.len() as u64))).unwrap();
    let start = std::time::Instant::now();
    let f = GgufFile::from_bytes(out).unwrap();
    let took = start.elapsed();
    assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap(), &tokens[..]);
    assert_eq!(f.tensors().len(), 2_000);
    assert_eq!(f.tensor_data("blk.1999.w").unwrap(), &bytes(136, "blk.1999.w".len() as u64)[..]);
    assert!(took.as_secs_f64() < 5.0, "parse took {took:?}");
}
