//! Perf cases at Qwen3.6 model sizes (n_embd 2048 and 5120, FFN 17408, head dim 128 and 256),
//! prefill (512 or 2048 tokens) and decode (1 to 8 tokens). Too large for the f64 judge; eval
//! mode covers the same ops at smaller sizes.

use tessera_ops::DType;

use super::matmul::MulMat;
use super::{BF16, F16, F32, I32, sh};
use crate::case::{Case, Init, InputSpec as In, Layout};

pub(super) fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    mul_mat(&mut out);
    rows_and_elementwise(&mut out);
    data(&mut out);
    // The hybrid-model families keep their model-sized cases next to their eval cases.
    out.extend(super::matmul::perf_cases());
    out.extend(super::reduce::perf_cases());
    out.extend(super::rope::perf_cases());
    out.extend(super::attention::perf_cases());
    out.extend(super::conv::perf_cases());
    out.extend(super::delta_net::perf_cases());
    out.extend(super::sample::perf_cases());
    out.extend(super::fused::perf_cases());
    out.extend(super::elemfuse::perf_cases());
    out
}

fn mul_mat(out: &mut Vec<Case>) {
    for type_a in [F32, F16, BF16] {
        out.push(MulMat::new(type_a, 1024, 1024, 1024).case());
    }
    // Decode GEMVs through the FFN up/gate (17408 x 5120) and down (5120 x 17408) weights.
    for type_a in [F32, F16, BF16] {
        out.push(MulMat::new(type_a, 17408, 1, 5120).case());
    }
    for type_a in [F16, BF16] {
        out.push(MulMat::new(type_a, 17408, 2, 5120).case());
        out.push(MulMat::new(type_a, 17408, 8, 5120).case());
        out.push(MulMat::new(type_a, 5120, 1, 17408).case());
    }
    // The 2048-wide model's QKV projection, decode and a 512-token prefill.
    out.push(MulMat::new(BF16, 6144, 1, 2048).case());
    out.push(MulMat::new(BF16, 6144, 512, 2048).case());
    // Attention over 4096 cached positions, 8 query heads per KV head.
    let mut kq = MulMat::new(F16, 4096, 1, 128);
    kq.bs_a = [4, 1];
    kq.bs_b = [32, 1];
    out.push(kq.case());
}

fn rows_and_elementwise(out: &mut Vec<Case>) {
    let big = [5120, 2048, 1, 1];
    out.push(Case::new(
        "rms_norm",
        format_args!("type=f32,ne={},eps=1e-6", sh(big)),
        vec![In::new("x", F32, big)],
        |g, x| g.rms_norm(x[0], 1e-6),
    ));
    out.push(Case::new(
        "rms_norm",
        "type=f32,ne=[2048,2048,1,1],eps=1e-6",
        vec![In::new("x", F32, [2048, 2048, 1, 1])],
        |g, x| g.rms_norm(x[0], 1e-6),
    ));
    // Per-head q norm of 512 tokens x 32 heads, read through the [head_dim, n_tokens, n_head] view.
    let heads = [128, 512, 32, 1];
    out.push(Case::new(
        "rms_norm",
        format_args!("type=f32,ne={},eps=1e-6", sh(heads)),
        vec![In::new("x", F32, heads).layout(Layout::SWAP12)],
        |g, x| g.rms_norm(x[0], 1e-6),
    ));
    for op in ["add", "mul"] {
        out.push(Case::new(
            op,
            format_args!("type_a=f32,type_b=f32,ne_a={},ne_b=[5120,1,1,1]", sh(big)),
            vec![In::new("a", F32, big), In::new("b", F32, [5120, 1, 1, 1])],
            move |g, x| if op == "add" { g.add(x[0], x[1]) } else { g.mul(x[0], x[1]) },
        ));
    }
    out.push(Case::new("silu", format_args!("type=f32,ne={}", sh(big)), vec![In::new("x", F32, big)], |g, x| {
        g.silu(x[0])
    }));
    out.push(Case::new("exp", format_args!("type=f32,ne={}", sh(big)), vec![In::new("x", F32, big)], |g, x| {
        g.exp(x[0])
    }));
    out.push(Case::new(
        "scale",
        format_args!("type=f32,ne={},scale=0.5", sh(big)),
        vec![In::new("x", F32, big)],
        |g, x| g.scale(x[0], 0.5),
    ));
    let ffn = [17408, 512, 1, 1];
    out.push(Case::new(
        "swiglu",
        format_args!("type=f32,ne={},split", sh(ffn)),
        vec![In::new("gate", F32, ffn), In::new("up", F32, ffn)],
        |g, x| g.swiglu(x[0], x[1]),
    ));
    out.push(Case::new("sum_rows", format_args!("type=f32,ne={}", sh(big)), vec![In::new("x", F32, big)], |g, x| {
        g.sum_rows(x[0])
    }));
    // Attention weights over 4096 positions for 512 tokens and over a 151936-token vocabulary.
    let att = [4096, 512, 1, 1];
    out.push(Case::new(
        "softmax",
        format_args!("type=f32,ne={},scale=0.0884,mask=f16{}", sh(att), sh(att)),
        vec![In::new("x", F32, att), In::new("mask", F16, att).init(Init::Mask)],
        |g, x| g.softmax(x[0], 0.088_388_35, Some(x[1])),
    ));
    let vocab = [151936, 8, 1, 1];
    out.push(Case::new(
        "softmax",
        format_args!("type=f32,ne={},scale=1,mask=none", sh(vocab)),
        vec![In::new("x", F32, vocab)],
        |g, x| g.softmax(x[0], 1.0, None),
    ));
    out.push(Case::new("argmax", format_args!("type=f32,ne={}", sh(vocab)), vec![In::new("x", F32, vocab)], |g, x| {
        g.argmax(x[0])
    }));
}

fn data(out: &mut Vec<Case>) {
    let big = [5120, 2048, 1, 1];
    for (from, to) in [(F32, F16), (F16, F32), (F32, BF16)] {
        out.push(cast(from, to, big));
    }
    // Embedding lookup of 512 tokens from a 32768-row f16 table.
    out.push(Case::new(
        "get_rows",
        "type=f16,ne=[5120,32768,1,1],n=512",
        vec![
            In::new("table", F16, [5120, 32768, 1, 1]),
            In::new("ids", I32, [512, 1, 1, 1]).init(Init::Ids { rows: 32768, unique: false }),
        ],
        |g, x| g.get_rows(x[0], x[1]),
    ));
    // Writing 512 tokens' K (8 heads x 128) into a 4096-slot f16 cache.
    out.push(Case::new(
        "set_rows",
        "type_dst=f16,type_src=f32,ne_dst=[1024,4096,1,1],n=512",
        vec![
            In::new("cache", F16, [1024, 4096, 1, 1]),
            In::new("k", F32, [1024, 512, 1, 1]),
            In::new("ids", I32, [512, 1, 1, 1]).init(Init::Ids { rows: 4096, unique: true }),
        ],
        |g, x| g.set_rows(x[0], x[1], x[2]),
    ));
    // Merging attention heads after attention: [128, 512 tokens, 32 heads] -> [128, 32, 512].
    out.push(Case::new(
        "cont",
        "type=f32,ne=[128,512,32,1]",
        vec![In::new("x", F32, [128, 512, 32, 1]).layout(Layout::SWAP12)],
        |g, x| g.cont(x[0]),
    ));
    out.push(Case::new(
        "cpy",
        "type_src=f32,type_dst=f16,ne_src=[1024,512,1,1],ne_dst=[1024,512,1,1]",
        vec![In::new("src", F32, [1024, 512, 1, 1]), In::new("dst", F16, [1024, 512, 1, 1])],
        |g, x| g.cpy(x[0], x[1]),
    ));
}

fn cast(from: DType, to: DType, ne: [usize; 4]) -> Case {
    Case::new(
        "cast",
        format_args!("type_src={from},type_dst={to},ne={}", sh(ne)),
        vec![In::new("x", from, ne)],
        move |g, x| g.cast(x[0], to),
    )
}
