//! Criterion bench of the GGUF tokenizer (`tessera_models::tokenizer`): encoding and decoding
//! 1 MiB of mixed text with the Qwen 3.5 vocabulary (151,936 tokens), the fixture of
//! models/tests/data/vocab/.
//!
//! The text is generated from a seed: English words and made-up words (so BPE does real
//! merging, not only cache hits), numbers, code, CJK, accented and Cyrillic words, emoji,
//! newlines and indentation. Throughput is in bytes of text.
//!
//! Run: `cargo bench -p tessera-benches --bench tokenizer`. The target (issue 24) is at least
//! 5 MB/s encoding on the 2-core development machine; docs/TEXT.md has the measured figure.

use std::io::Read;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tessera_models::gguf::GgufFile;
use tessera_models::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/data/vocab/ggml-vocab-qwen35.gguf.gz");
    let gz = std::fs::read(path).expect("the vocabulary fixture");
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_end(&mut bytes).expect("gzip");
    Tokenizer::from_gguf(&GgufFile::from_bytes(bytes).expect("GGUF")).expect("tokenizer")
}

/// `n` bytes (or a few more) of mixed text from a fixed seed.
fn mixed_text(n: usize) -> String {
    const WORDS: &str = "the of and to in is that for it as was with be by on not he this are or his from at \
        which but have an had they you were their one all we can her has there been if more when will would who so \
        no tokenizer language model attention gradient kernel memory throughput sequence history government \
        international understanding Hello World However Therefore The In It's don't we'll they're I'm";
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    const OTHER: &[&str] = &[
        "我想在apple工作",
        "今天天气很好",
        "機械学習モデル",
        "нещо на Български",
        "Cửa Việt",
        "Äpfel",
        "naïve café",
        "🚀",
        "😶‍🌫️",
        "✅",
        "🦙.cpp",
        "fn main() {\n    println!(\"{}\", x);\n}\n",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "x = [1, 2, 3]\n",
        "\n\n",
        "  ",
        "...",
        "(see §3)",
    ];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut s = String::with_capacity(n + 64);
    while s.len() < n {
        let r = next();
        match r % 100 {
            0..=64 => {
                s.push(' ');
                s.push_str(words[(r >> 8) as usize % words.len()]);
            }
            65..=79 => {
                // A made-up word of 3..=12 letters.
                s.push(' ');
                for k in 0..3 + (r >> 8) % 10 {
                    s.push(char::from(b'a' + ((r >> (16 + 2 * k)) % 26) as u8));
                }
            }
            80..=87 => {
                s.push(' ');
                s.push_str(&((r >> 8) % 100_000).to_string());
            }
            88..=95 => s.push_str(OTHER[(r >> 8) as usize % OTHER.len()]),
            _ => s.push_str(if r & 256 == 0 { ".\n" } else { ", " }),
        }
    }
    s
}

fn bench_tokenizer(c: &mut Criterion) {
    let tok = tokenizer();
    let text = mixed_text(1 << 20);
    let ids = tok.encode(&text);
    assert_eq!(tok.decode(&ids, true).expect("decode"), text, "round trip");
    let mut g = c.benchmark_group("tokenizer");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("encode_1MiB_mixed", |b| b.iter(|| tok.encode(std::hint::black_box(&text))));
    g.bench_function("decode_1MiB_mixed", |b| b.iter(|| tok.decode(std::hint::black_box(&ids), true)));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    targets = bench_tokenizer
}
criterion_main!(benches);
