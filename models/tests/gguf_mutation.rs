//! Hostile GGUF input: files assembled by hand (independently of the writer) with every field's
//! position recorded, then truncated, bit-flipped and overwritten with hostile values. Opening must
//! never panic, and must either fail with an error or succeed with every invariant holding. Then
//! targeted cases assert the exact error.

use std::panic::{AssertUnwindSafe, catch_unwind};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tessera_models::gguf::{GgufError, GgufFile, GgufWriter};

/// What a recorded field holds; mutations pick values by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Magic,
    Version,
    TensorCount,
    KvCount,
    StrLen,
    ValueType,
    ArrayType,
    ArrayLen,
    Bool,
    NDims,
    Dim,
    GgmlType,
    Offset,
    Alignment,
}

#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    width: usize,
    kind: Kind,
}

/// A byte assembler that records where each structural field is.
#[derive(Debug, Clone, Default)]
struct Asm {
    b: Vec<u8>,
    fields: Vec<Field>,
}

impl Asm {
    fn u32(&mut self, kind: Option<Kind>, v: u32) -> &mut Self {
        if let Some(kind) = kind {
            self.fields.push(Field { at: self.b.len(), width: 4, kind });
        }
        self.b.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, kind: Option<Kind>, v: u64) -> &mut Self {
        if let Some(kind) = kind {
            self.fields.push(Field { at: self.b.len(), width: 8, kind });
        }
        self.b.extend(v.to_le_bytes());
        self
    }
    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.b.extend(bytes);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(Some(Kind::StrLen), s.len() as u64).raw(s.as_bytes())
    }
    fn header(version: u32, tensors: u64, kvs: u64) -> Asm {
        let mut a = Asm::default();
        a.fields.push(Field { at: 0, width: 4, kind: Kind::Magic });
        a.raw(b"GGUF")
            .u32(Some(Kind::Version), version)
            .u64(Some(Kind::TensorCount), tensors)
            .u64(Some(Kind::KvCount), kvs);
        a
    }
    /// A kv header: key and value type id.
    fn kv(&mut self, key: &str, type_id: u32) -> &mut Self {
        self.str(key).u32(Some(Kind::ValueType), type_id)
    }
    fn array_header(&mut self, elem: u32, n: u64) -> &mut Self {
        self.u32(Some(Kind::ArrayType), elem).u64(Some(Kind::ArrayLen), n)
    }
    fn tensor_info(&mut self, name: &str, dims: &[u64], ggml_type: u32, offset: u64) -> &mut Self {
        self.str(name).u32(Some(Kind::NDims), dims.len() as u32);
        for &d in dims {
            self.u64(Some(Kind::Dim), d);
        }
        self.u32(Some(Kind::GgmlType), ggml_type).u64(Some(Kind::Offset), offset)
    }
    fn pad(&mut self, align: usize) -> &mut Self {
        let n = self.b.len().next_multiple_of(align);
        self.b.resize(n, 0);
        self
    }
}

/// A valid base file: every value type, nested arrays, 4 tensors of different dtypes.
fn base(alignment: Option<u32>) -> Asm {
    let align = alignment.unwrap_or(32) as usize;
    let kvs = 17 + u64::from(alignment.is_some());
    let mut a = Asm::header(3, 4, kvs);
    if let Some(al) = alignment {
        a.kv("general.alignment", 4).u32(Some(Kind::Alignment), al);
    }
    a.kv("general.architecture", 8).str("qwen35");
    a.kv("u8", 0).raw(&[7]);
    a.kv("i8", 1).raw(&[0xff]);
    a.kv("u16", 2).raw(&[1, 2]);
    a.kv("i16", 3).raw(&[1, 0x80]);
    a.kv("u32", 4).u32(None, 40);
    a.kv("i32", 5).u32(None, (-5i32) as u32);
    a.kv("f32", 6).raw(&1e-6f32.to_le_bytes());
    a.kv("bool", 7);
    a.fields.push(Field { at: a.b.len(), width: 1, kind: Kind::Bool });
    a.raw(&[1]);
    a.kv("empty", 8).str("");
    a.kv("u64", 10).u64(None, 1 << 40);
    a.kv("i64", 11).u64(None, (-1i64) as u64);
    a.kv("f64", 12).raw(&0.5f64.to_le_bytes());
    a.kv("tokens", 9).array_header(8, 3).str("a").str("").str("ccc");
    a.kv("sections", 9).array_header(5, 4).u32(None, 11).u32(None, 11).u32(None, 10).u32(None, 0);
    // [[1u16, 2u16], [], [[true]]]
    a.kv("nested", 9).array_header(9, 3);
    a.array_header(2, 2).raw(&[1, 0, 2, 0]);
    a.array_header(6, 0);
    a.array_header(9, 1).array_header(7, 1);
    a.fields.push(Field { at: a.b.len(), width: 1, kind: Kind::Bool });
    a.raw(&[1]);
    a.kv("flags", 9).array_header(7, 2).raw(&[0, 1]);
    // Tensors: f32 [4, 2] (32 B), q8_0 [32] (34 B), nvfp4 [64, 1] (36 B), i32 [3] (12 B).
    let sizes = [32usize, 34, 36, 12];
    let mut offsets = [0u64; 4];
    for i in 1..4 {
        offsets[i] = offsets[i - 1] + sizes[i - 1].next_multiple_of(align) as u64;
    }
    a.tensor_info("blk.0.attn_q.weight", &[4, 2], 0, offsets[0]);
    a.tensor_info("blk.0.ffn_up.weight", &[32], 8, offsets[1]);
    a.tensor_info("blk.0.ffn_down.weight", &[64, 1], 40, offsets[2]);
    a.tensor_info("ids", &[3], 26, offsets[3]);
    a.pad(align);
    for (i, &s) in sizes.iter().enumerate() {
        a.raw(&vec![i as u8 + 1; s]).pad(align);
    }
    a
}

fn bases() -> Vec<Asm> {
    vec![base(None), base(Some(64)), base(Some(8))]
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Opens `bytes`, turning a panic into a failure that shows the input, and checks every invariant
/// of a successful parse. Returns whether it parsed.
fn open_checked(bytes: &[u8]) -> bool {
    outcome(bytes).is_none()
}

/// Like [`open_checked`], returning the error variant's name, or `None` when the file parsed.
fn outcome(bytes: &[u8]) -> Option<String> {
    let opened = catch_unwind(AssertUnwindSafe(|| GgufFile::from_bytes(bytes.to_vec())));
    let result = match opened {
        Ok(r) => r,
        Err(_) => panic!("GgufFile::from_bytes panicked on input ({} bytes): {}", bytes.len(), hex(bytes)),
    };
    let f = match result {
        Ok(f) => f,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            let debug = format!("{e:?}");
            return Some(debug.split([' ', '(', '{']).next().unwrap_or_default().to_string());
        }
    };
    let checked = catch_unwind(AssertUnwindSafe(|| check_invariants(&f, bytes)));
    if checked.is_err() {
        panic!("invariants failed for input ({} bytes): {}", bytes.len(), hex(bytes));
    }
    None
}

fn check_invariants(f: &GgufFile, bytes: &[u8]) {
    assert!(matches!(f.version(), 2 | 3));
    let align = f.alignment();
    assert!(align.is_power_of_two());
    assert_eq!(f.data_offset() % align, 0);
    let mut ranges = Vec::new();
    for t in f.tensors() {
        assert!((1..=4).contains(&t.n_dims));
        assert!(t.ne.iter().all(|&n| n >= 1));
        assert!(t.ne[t.n_dims..].iter().all(|&n| n == 1));
        let rows: usize = t.ne[1..].iter().product();
        assert_eq!(Some(t.size), t.dtype.row_bytes(t.ne[0]).and_then(|r| r.checked_mul(rows)));
        assert_eq!(t.offset % align as u64, 0);
        let data = f.tensor_data(&t.name).unwrap();
        assert_eq!(data.len(), t.size);
        let start = f.data_offset() + t.offset as usize;
        assert_eq!(data, &bytes[start..start + t.size]);
        assert_eq!(f.tensor(&t.name), Some(t));
        ranges.push((start, start + t.size));
    }
    ranges.sort();
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "tensors overlap");
    for (k, v) in f.metadata() {
        assert!(std::ptr::eq(f.get(k).unwrap(), v), "keys are unique");
    }
    // Whatever parsed can be written again and reads back the same.
    let again = GgufWriter::from_file(f).unwrap().to_bytes().unwrap();
    let g = GgufFile::from_bytes(again.clone()).unwrap();
    assert_eq!(GgufWriter::from_file(&g).unwrap().to_bytes().unwrap(), again);
}

/// Hostile replacement values for a field of `kind`; `pick` chooses one, `random` is a wildcard.
fn hostile_value(kind: Kind, orig: u64, pick: u64, random: u64, offsets: &[u64]) -> u64 {
    let counts = [0, 1, 2, 3, orig.wrapping_add(1), orig.wrapping_sub(1), 1 << 31, 1 << 32, 1 << 40, 1 << 50, 1 << 60];
    let counts_tail = [u64::MAX, i64::MAX as u64, random];
    let list: Vec<u64> = match kind {
        Kind::Magic => vec![0x4655_4746, 0x4747_5546, 0, random],
        Kind::Version => vec![0, 1, 2, 4, 0x0300_0000, u32::MAX as u64, random],
        Kind::TensorCount | Kind::KvCount | Kind::StrLen | Kind::ArrayLen | Kind::Dim => {
            counts.iter().chain(&counts_tail).copied().collect()
        }
        Kind::ValueType | Kind::ArrayType => (0..=14).chain([100, u32::MAX as u64, random]).collect(),
        Kind::Bool => vec![0, 1, 2, 0xff, random],
        Kind::NDims => vec![0, 1, 2, 3, 4, 5, 64, u32::MAX as u64, random],
        Kind::GgmlType => vec![0, 1, 2, 8, 26, 30, 39, 40, 41, 1000, u32::MAX as u64, random],
        Kind::Offset => {
            let mut v: Vec<u64> = offsets.to_vec();
            v.extend([
                orig.wrapping_add(1),
                orig.wrapping_add(16),
                orig.wrapping_add(32),
                orig.wrapping_add(64),
                orig.wrapping_sub(32),
                1 << 40,
                u64::MAX - 7,
                random,
            ]);
            v
        }
        Kind::Alignment => vec![0, 1, 2, 3, 8, 16, 31, 48, 64, 1 << 20, 1 << 31, u32::MAX as u64, random],
    };
    list[(pick % list.len() as u64) as usize]
}

/// One mutation: `op` selects the kind, the rest are raw choices.
fn mutate(asm: &Asm, ops: &[(u8, u64, u64, u64)]) -> Vec<u8> {
    let mut b = asm.b.clone();
    let offsets: Vec<u64> = asm
        .fields
        .iter()
        .filter(|f| f.kind == Kind::Offset)
        .map(|f| u64::from_le_bytes(asm.b[f.at..f.at + 8].try_into().unwrap()))
        .collect();
    for &(op, a, pick, random) in ops {
        match op % 5 {
            // Overwrite a structural field (twice as likely as the others).
            0 | 1 => {
                let f = asm.fields[(a % asm.fields.len() as u64) as usize];
                if f.at + f.width > b.len() {
                    continue;
                }
                let mut orig = [0u8; 8];
                orig[..f.width].copy_from_slice(&b[f.at..f.at + f.width]);
                let v = hostile_value(f.kind, u64::from_le_bytes(orig), pick, random, &offsets);
                b[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
            }
            // Flip bits of a random byte.
            2 if !b.is_empty() => {
                let i = (a % b.len() as u64) as usize;
                b[i] ^= (pick as u8).max(1);
            }
            // Truncate at a random position, or just inside a field.
            3 if !b.is_empty() => {
                let at = if pick % 2 == 0 {
                    (a % b.len() as u64) as usize
                } else {
                    let f = asm.fields[(a % asm.fields.len() as u64) as usize];
                    f.at + (random % f.width as u64) as usize
                };
                b.truncate(at);
            }
            // Insert or delete a few bytes, shifting everything after.
            _ if !b.is_empty() => {
                let i = (a % b.len() as u64) as usize;
                let n = (pick % 9) as usize + 1;
                if random % 2 == 0 {
                    b.splice(i..i, random.to_le_bytes().into_iter().cycle().take(n));
                } else {
                    b.drain(i..(i + n).min(b.len()));
                }
            }
            _ => {}
        }
    }
    b
}

#[test]
fn bases_parse_and_hold_invariants() {
    for a in bases() {
        assert!(open_checked(&a.b));
        let f = GgufFile::from_bytes(a.b.clone()).unwrap();
        assert_eq!(f.tensors().len(), 4);
        assert_eq!(f.tensor_data("blk.0.ffn_up.weight").unwrap(), &[2u8; 34][..]);
        // The writer re-encodes the hand-assembled file byte for byte.
        assert_eq!(GgufWriter::from_file(&f).unwrap().to_bytes().unwrap(), a.b);
    }
}

/// Every prefix of every base file: each is an error (the last tensor's padding is optional, so a
/// cut inside it still parses).
#[test]
fn every_truncation_fails_cleanly() {
    let mut n = 0;
    for a in bases() {
        let f = GgufFile::from_bytes(a.b.clone()).unwrap();
        let last = f.tensors().iter().map(|t| f.data_offset() + t.offset as usize + t.size).max().unwrap();
        for len in 0..a.b.len() {
            let ok = open_checked(&a.b[..len]);
            assert_eq!(ok, len >= last, "prefix of {len} bytes (data ends at {last})");
            n += 1;
        }
    }
    eprintln!("truncations checked: {n}");
    assert!(n > 1000);
}

/// Random mutations: structural fields overwritten with hostile values, bit flips, truncations,
/// insertions and deletions, one to four at a time.
#[test]
fn mutated_files_never_panic() {
    let bases = bases();
    let cases = 10_000;
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let strategy = (0..bases.len(), prop::collection::vec(any::<(u8, u64, u64, u64)>(), 1..=4));
    let total = std::cell::Cell::new(0u32);
    let tally = std::cell::RefCell::new(std::collections::BTreeMap::<String, u32>::new());
    runner
        .run(&strategy, |(which, ops)| {
            let bytes = mutate(&bases[which], &ops);
            total.set(total.get() + 1);
            let key = outcome(&bytes).unwrap_or_else(|| "parsed".into());
            *tally.borrow_mut().entry(key).or_default() += 1;
            Ok(())
        })
        .unwrap();
    let tally = tally.into_inner();
    eprintln!("mutated files: {}; outcomes: {tally:?}", total.get());
    assert!(total.get() >= cases);
    // The mutations reach the deep checks, not just the header.
    let expected = [
        "Truncated",
        "TooLarge",
        "UnknownValueType",
        "UnknownTensorType",
        "BadDims",
        "OutOfBounds",
        "Misaligned",
        "Overlap",
        "parsed",
    ];
    for v in expected {
        assert!(tally.contains_key(v), "no mutation produced {v}: {tally:?}");
    }
}

/// Every structural field of every base overwritten with every hostile value of its kind.
#[test]
fn every_field_with_every_hostile_value() {
    let mut n = 0;
    for a in bases() {
        for fi in 0..a.fields.len() {
            for pick in 0..20 {
                let bytes = mutate(&a, &[(0, fi as u64, pick, 0xdead_beef_dead_beef)]);
                open_checked(&bytes);
                n += 1;
            }
        }
    }
    eprintln!("field overwrites checked: {n}");
}

// ---- targeted hostile cases ----

fn err_of(b: &[u8]) -> GgufError {
    match GgufFile::from_bytes(b.to_vec()) {
        Ok(_) => panic!("expected an error for {}", hex(b)),
        Err(e) => e,
    }
}

/// A file with one u8 kv and one tensor info, then `data` bytes of data section.
fn one_tensor(name: &str, dims: &[u64], ggml_type: u32, offset: u64, data: usize) -> Asm {
    let mut a = Asm::header(3, 1, 1);
    a.kv("k", 0).raw(&[1]);
    a.tensor_info(name, dims, ggml_type, offset).pad(32).raw(&vec![0u8; data]);
    a
}

#[test]
fn bad_magic_and_versions() {
    let mut a = Asm::header(3, 0, 0);
    a.b[..4].copy_from_slice(b"GGML");
    assert!(matches!(err_of(&a.b), GgufError::BadMagic { found } if &found == b"GGML"));
    let e = err_of(&Asm::header(1, 0, 0).b);
    assert!(matches!(e, GgufError::UnsupportedVersion { version: 1, .. }) && e.to_string().contains("32-bit"), "{e}");
    let e = err_of(&Asm::header(0x0300_0000, 0, 0).b);
    assert!(e.to_string().contains("big-endian"), "{e}");
    let e = err_of(&[]);
    assert!(matches!(&e, GgufError::Truncated { what, offset: 0, .. } if what.contains("magic")), "{e}");
}

#[test]
fn huge_string_length_fails_fast() {
    let mut a = Asm::header(3, 0, 1);
    // 13 bytes after the header: enough for the kv count's bound (a kv is at least 13 bytes).
    a.u64(None, 1 << 60).raw(b"key..");
    let e = err_of(&a.b);
    assert!(
        matches!(&e, GgufError::Truncated { what, offset: 32, need, available: 5 } if what == "key of metadata kv #0" && *need == 1 << 60),
        "{e}"
    );
}

#[test]
fn huge_array_fails_fast() {
    let mut a = Asm::header(3, 0, 1);
    a.kv("arr", 9).array_header(4, 1 << 50).u32(None, 1);
    let e = err_of(&a.b);
    assert!(
        matches!(&e, GgufError::TooLarge { what, value, max: 1 } if what.contains("array length") && what.contains("`arr`") && *value == 1 << 50),
        "{e}"
    );
    // Strings are bounded by their 8-byte lengths, nested arrays by their 12-byte headers.
    let mut a = Asm::header(3, 0, 1);
    a.kv("arr", 9).array_header(8, 2).u64(None, 0);
    assert!(matches!(err_of(&a.b), GgufError::TooLarge { value: 2, max: 1, .. }));
}

#[test]
fn huge_counts_fail_fast() {
    let e = err_of(&Asm::header(3, 0, 1 << 40).b);
    assert!(
        matches!(&e, GgufError::TooLarge { what, value, max: 0 } if what == "metadata kv count" && *value == 1 << 40)
    );
    let e = err_of(&Asm::header(3, u64::MAX, 0).b);
    assert!(matches!(&e, GgufError::TooLarge { what, .. } if what == "tensor count"), "{e}");
}

#[test]
fn unknown_value_type_invalid_utf8_and_bool() {
    let mut a = Asm::header(3, 0, 1);
    a.kv("k", 13).raw(&[0; 8]);
    let e = err_of(&a.b);
    assert!(matches!(&e, GgufError::UnknownValueType { type_id: 13, offset: 33, what } if what.contains("`k`")), "{e}");
    let mut a = Asm::header(3, 0, 1);
    a.kv("k", 9).array_header(77, 0);
    assert!(matches!(err_of(&a.b), GgufError::UnknownValueType { type_id: 77, .. }));
    let mut a = Asm::header(3, 0, 1);
    a.u64(None, 2).raw(&[0xc3, 0x28]).u32(None, 0).raw(&[0]);
    assert!(matches!(err_of(&a.b), GgufError::InvalidUtf8 { offset: 32, .. }));
    let mut a = Asm::header(3, 0, 1);
    a.kv("b", 7).raw(&[2]);
    let e = err_of(&a.b);
    assert!(matches!(&e, GgufError::InvalidBool { byte: 2, .. }), "{e}");
}

#[test]
fn duplicates_are_errors() {
    let mut a = Asm::header(3, 0, 2);
    a.kv("k", 0).raw(&[1]).kv("k", 0).raw(&[2]);
    assert!(matches!(err_of(&a.b), GgufError::DuplicateKey { key } if key == "k"));
    let mut a = Asm::header(3, 2, 0);
    a.tensor_info("t", &[4], 0, 0).tensor_info("t", &[4], 0, 32).pad(32).raw(&[0; 64]);
    assert!(matches!(err_of(&a.b), GgufError::DuplicateTensor { name } if name == "t"));
}

#[test]
fn unknown_tensor_type_names_tensor_and_id() {
    let e = err_of(&one_tensor("blk.3.w", &[32], 2, 0, 32).b);
    assert!(matches!(&e, GgufError::UnknownTensorType { name, type_id: 2 } if name == "blk.3.w"), "{e}");
}

#[test]
fn bad_dims() {
    for (dims, ty, needle) in [
        (&[][..], 0, "n_dims is 0"),
        (&[1, 1, 1, 1, 1][..], 0, "n_dims is 5"),
        (&[4, 0][..], 0, "ne[1] is 0"),
        (&[31][..], 8, "whole number of q8_0 blocks"),
        (&[1 << 62, 1 << 62][..], 0, "overflows"),
    ] {
        let e = err_of(&one_tensor("w", dims, ty, 0, 64).b);
        assert!(matches!(&e, GgufError::BadDims { name, reason } if name == "w" && reason.contains(needle)), "{e}");
    }
}

#[test]
fn bad_alignment_values() {
    for v in [0u32, 3, 48] {
        let mut a = Asm::header(3, 0, 1);
        a.kv("general.alignment", 4).u32(None, v);
        assert!(matches!(err_of(&a.b), GgufError::BadAlignment { value } if value == u64::from(v)), "{v}");
    }
    let mut a = Asm::header(3, 0, 1);
    a.kv("general.alignment", 10).u64(None, 32);
    let e = err_of(&a.b);
    assert!(
        matches!(&e, GgufError::WrongType { key, expected: "u32", found } if key == "general.alignment" && found == "u64")
    );
}

#[test]
fn misaligned_out_of_bounds_and_overlapping_tensors() {
    let e = err_of(&one_tensor("w", &[4], 0, 16, 64).b);
    assert!(matches!(&e, GgufError::Misaligned { name, offset: 16, alignment: 32 } if name == "w"), "{e}");
    let e = err_of(&one_tensor("w", &[4], 0, 32, 40).b);
    assert!(matches!(&e, GgufError::OutOfBounds { name, offset: 32, size: 16, data_len: 40 } if name == "w"), "{e}");
    let e = err_of(&one_tensor("w", &[4], 0, u64::MAX - 31, 64).b);
    assert!(matches!(e, GgufError::OutOfBounds { .. }), "{e}");
    let mut a = Asm::header(3, 2, 0);
    a.tensor_info("a", &[16], 0, 0).tensor_info("b", &[4], 0, 32).pad(32).raw(&[0; 96]);
    let e = err_of(&a.b);
    assert!(
        matches!(&e, GgufError::Overlap { first, first_end: 64, second, second_start: 32, .. } if first == "a" && second == "b"),
        "{e}"
    );
    // Out of order but disjoint is fine.
    let mut a = Asm::header(3, 2, 0);
    a.tensor_info("a", &[4], 0, 32).tensor_info("b", &[4], 0, 0).pad(32).raw(&[0; 64]);
    assert!(open_checked(&a.b));
}

#[test]
fn nesting_depth_is_limited() {
    let mut a = Asm::header(3, 0, 1);
    a.kv("deep", 9);
    for _ in 0..10_000 {
        a.array_header(9, 1);
    }
    let e = err_of(&a.b);
    assert!(matches!(&e, GgufError::NestingTooDeep { what, max: 8 } if what.contains("`deep`")), "{e}");
}

#[test]
fn truncation_names_the_field_and_offset() {
    let a = one_tensor("blk.0.attn_qkv.weight", &[4, 2], 0, 0, 32);
    // Cut inside ne[1] of the tensor info (the name is long enough that the tensor count's bound,
    // 32 bytes per info, still passes).
    let dim1 = a.fields.iter().filter(|f| f.kind == Kind::Dim).nth(1).unwrap().at;
    let e = err_of(&a.b[..dim1 + 3]);
    assert!(
        matches!(&e, GgufError::Truncated { what, offset, need: 8, available: 3 } if what == "dim 1 of tensor info #0 `blk.0.attn_qkv.weight`" && *offset == dim1 as u64),
        "{e}"
    );
    assert!(e.to_string().contains(&format!("at byte {dim1}")), "{e}");
    // Cut inside the padding before the data section.
    let header_end = a.fields.last().unwrap().at + 8;
    let e = err_of(&a.b[..header_end + 1]);
    assert!(matches!(&e, GgufError::Truncated { what, .. } if what.contains("padding")), "{e}");
    // A file with no tensors needs no padding or data.
    let mut a = Asm::header(3, 0, 1);
    a.kv("k", 0).raw(&[1]);
    assert!(open_checked(&a.b));
}

#[test]
fn open_rejects_hostile_file_on_disk() {
    let path = std::env::temp_dir().join(format!("tessera_gguf_hostile_{}.gguf", std::process::id()));
    std::fs::write(&path, Asm::header(3, 0, 1 << 40).b).unwrap();
    assert!(matches!(GgufFile::open(&path), Err(GgufError::TooLarge { .. })));
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(GgufFile::open(&path), Err(GgufError::Truncated { .. })));
    std::fs::remove_file(&path).unwrap();
}
