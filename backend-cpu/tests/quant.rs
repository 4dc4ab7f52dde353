//! Block-quantized data through whole sessions on the CPU backend and the f64 reference:
//! `quantize` writes exactly `tessera_ops::quant`'s bytes, `dequantize` and `get_rows` read them
//! back exactly, and the NVFP4 per-tensor scale (`<name>.scale`, llama.cpp's `weight_scale_2`)
//! is applied as a `mul` after `mul_mat` / `mul_mat_id`, which equals a matmul with the
//! dequantized weights times the scale.

use tessera_cpu::{CpuBackend, ReferenceBackend};
use tessera_graph::{Backend, Graph, Session};
use tessera_ops::{DType, host, quant};

const F32: DType = DType::F32;
const QUANTS: [DType; 2] = [DType::Q8_0, DType::NvFp4];

/// Fixed inputs with varied magnitudes per block (including an all-zero block and ties).
fn fixed_values(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let block = i / 64;
            let scale = [1.0, 0.01, 250.0, 0.0, 3.5][block % 5];
            let x = ((i * 7919) % 2003) as f32 / 1001.5 - 1.0;
            if i % 17 == 0 { scale * 0.5 } else { scale * x }
        })
        .collect()
}

fn quantizer_bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; dtype.row_bytes(v.len()).unwrap()];
    match dtype {
        DType::Q8_0 => quant::quantize_q8_0(v, &mut out).unwrap(),
        _ => quant::quantize_nvfp4(v, &mut out).unwrap(),
    }
    out
}

fn backends() -> [Box<dyn Backend>; 2] {
    [Box::new(CpuBackend::new()), Box::new(ReferenceBackend::new())]
}

#[test]
fn quantize_writes_the_quantizer_bytes_exactly_on_both_backends() {
    for dtype in QUANTS {
        for ne in [[64, 1, 1, 1], [320, 5, 1, 1], [2048, 3, 1, 1], [5120, 2, 1, 1], [128, 3, 2, 1]] {
            let n: usize = ne.iter().product();
            let v = fixed_values(n);
            let want = quantizer_bytes(dtype, &v);
            for mut backend in backends() {
                let mut g = Graph::new();
                let x = g.input("x", F32, ne).unwrap();
                let q = g.quantize(x, dtype).unwrap();
                let d = g.dequantize(q).unwrap();
                g.mark_output(q).unwrap();
                g.mark_output(d).unwrap();
                let name = backend.name().to_string();
                let mut s = Session::new(&g, backend.as_mut()).unwrap();
                s.set_f32(x, &v).unwrap();
                s.run().unwrap();
                assert!(s.get(q).unwrap() == want, "{name}: quantize({dtype}) of {ne:?} differs from ops::quant");
                let back = s.get_f64(d).unwrap();
                assert_eq!(back, host::decode(dtype, &want), "{name}: dequantize({dtype}) of {ne:?}");
            }
        }
    }
}

#[test]
fn quantize_of_a_permuted_input_quantizes_the_logical_rows() {
    for dtype in QUANTS {
        let v = fixed_values(128 * 6);
        for mut backend in backends() {
            let mut g = Graph::new();
            let x = g.input("x", F32, [128, 2, 3, 1]).unwrap();
            let p = g.permute(x, [0, 2, 1, 3]).unwrap(); // [128, 3, 2]
            let q = g.quantize(p, dtype).unwrap();
            g.mark_output(q).unwrap();
            let mut s = Session::new(&g, backend.as_mut()).unwrap();
            s.set_f32(x, &v).unwrap();
            s.run().unwrap();
            // logical row (i1, i2) of p is row (i2, i1) of x
            let mut logical = Vec::new();
            for i2 in 0..2 {
                for i1 in 0..3 {
                    let r = i2 + 2 * i1;
                    logical.extend_from_slice(&v[r * 128..(r + 1) * 128]);
                }
            }
            assert!(s.get(q).unwrap() == quantizer_bytes(dtype, &logical), "{dtype}");
        }
    }
}

#[test]
fn get_rows_of_a_quantized_table_gives_the_dequantized_rows() {
    for dtype in QUANTS {
        let v = fixed_values(256 * 10);
        let bytes = quantizer_bytes(dtype, &v);
        let table = host::decode(dtype, &bytes);
        let rows = [9, 0, 3, 3];
        for mut backend in backends() {
            let mut g = Graph::new();
            let t = g.parameter("token_embd", dtype, [256, 10, 1, 1]).unwrap();
            let ids = g.input("ids", DType::I32, [4, 1, 1, 1]).unwrap();
            let y = g.get_rows(t, ids).unwrap();
            g.mark_output(y).unwrap();
            let mut s = Session::new(&g, backend.as_mut()).unwrap();
            s.set(t, &bytes).unwrap();
            s.set_i32(ids, &rows).unwrap();
            s.run().unwrap();
            let want: Vec<f64> = rows.iter().flat_map(|&r| table[r as usize * 256..][..256].to_vec()).collect();
            assert_eq!(s.get_f64(y).unwrap(), want, "{dtype}");
        }
    }
}

fn nmse(got: &[f32], want: &[f32]) -> f64 {
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    err / norm
}

/// llama.cpp `build_lora_mm`: `res = mul_mat(w, x); if (w_s) res = mul(res, w_s)`. Tessera does
/// the same in the model graph: a `mul` by the `[1]` f32 scale after `mul_mat`.
#[test]
fn nvfp4_per_tensor_scale_is_a_mul_after_mul_mat() {
    let (k, m) = (256, 20);
    let w_vals = fixed_values(k * m);
    let w_bytes = quantizer_bytes(DType::NvFp4, &w_vals);
    let scale = 0.003_172_f32; // like amax / (6 * 448)
    // The dequantized weights, scaled: what the checkpoint's real weight is.
    let w_real: Vec<f32> = host::decode(DType::NvFp4, &w_bytes).iter().map(|&v| v as f32 * scale).collect();
    for n in [1, 3, 9] {
        let x_vals: Vec<f32> = (0..k * n).map(|i| ((i * 31) % 97) as f32 / 48.5 - 1.0).collect();
        for mut backend in backends() {
            let mut g = Graph::new();
            let w = g.parameter("blk.0.ffn_up.weight", DType::NvFp4, [k, m, 1, 1]).unwrap();
            let s_t = g.parameter("blk.0.ffn_up.scale", F32, [1, 1, 1, 1]).unwrap();
            let wf = g.parameter("w_real", F32, [k, m, 1, 1]).unwrap();
            let x = g.input("x", F32, [k, n, 1, 1]).unwrap();
            let mm = g.mul_mat(w, x).unwrap();
            let scaled = g.mul(mm, s_t).unwrap();
            let want = g.mul_mat(wf, x).unwrap();
            g.mark_output(scaled).unwrap();
            g.mark_output(want).unwrap();
            let name = backend.name().to_string();
            let mut s = Session::new(&g, backend.as_mut()).unwrap();
            s.set(w, &w_bytes).unwrap();
            s.set_f32(s_t, &[scale]).unwrap();
            s.set_f32(wf, &w_real).unwrap();
            s.set_f32(x, &x_vals).unwrap();
            s.run().unwrap();
            let (got, want) = (s.get_f32(scaled).unwrap(), s.get_f32(want).unwrap());
            let e = nmse(&got, &want);
            assert!(e < 1e-12, "{name} n={n}: nmse {e:e}");
        }
    }
}

/// llama.cpp `build_lora_mm_id`: the per-expert scales `[n_expert]` are viewed as
/// `[1, n_expert, 1]`, repeated over tokens, gathered with the routing ids and multiplied into
/// the mul_mat_id output.
#[test]
fn nvfp4_per_expert_scale_is_a_gathered_mul_after_mul_mat_id() {
    let (k, n, n_expert, n_used, n_tokens) = (128, 12, 4, 2, 3);
    let w_vals = fixed_values(k * n * n_expert);
    let w_bytes = quantizer_bytes(DType::NvFp4, &w_vals);
    let scales = [0.5f32, 0.002, 1.75, 0.031];
    let deq = host::decode(DType::NvFp4, &w_bytes);
    let expert_len = k * n;
    let w_real: Vec<f32> = deq.iter().enumerate().map(|(i, &v)| v as f32 * scales[i / expert_len]).collect();
    let ids_v = [1, 3, 0, 2, 3, 1];
    let x_vals: Vec<f32> = (0..k * n_tokens).map(|i| ((i * 13) % 101) as f32 / 50.5 - 1.0).collect();
    for mut backend in backends() {
        let mut g = Graph::new();
        let w = g.parameter("ffn_up_exps.weight", DType::NvFp4, [k, n, n_expert, 1]).unwrap();
        let sc_leaf = g.parameter("ffn_up_exps.scale", F32, [n_expert, 1, 1, 1]).unwrap();
        let wf = g.parameter("w_real", F32, [k, n, n_expert, 1]).unwrap();
        let x = g.input("x", F32, [k, 1, n_tokens, 1]).unwrap();
        let ids = g.input("ids", DType::I32, [n_used, n_tokens, 1, 1]).unwrap();
        let y = g.mul_mat_id(w, x, ids).unwrap(); // [n, n_used, n_tokens]
        let sc = g.reshape(sc_leaf, &[1, n_expert, 1, 1]).unwrap();
        let sc = g.repeat(sc, &[1, n_expert, n_tokens, 1]).unwrap();
        let sel = g.get_rows(sc, ids).unwrap(); // [1, n_used, n_tokens]
        let scaled = g.mul(y, sel).unwrap();
        let want = g.mul_mat_id(wf, x, ids).unwrap();
        g.mark_output(scaled).unwrap();
        g.mark_output(want).unwrap();
        let name = backend.name().to_string();
        let mut s = Session::new(&g, backend.as_mut()).unwrap();
        s.set(w, &w_bytes).unwrap();
        s.set_f32(sc_leaf, &scales).unwrap();
        s.set_f32(wf, &w_real).unwrap();
        s.set_f32(x, &x_vals).unwrap();
        s.set_i32(ids, &ids_v).unwrap();
        s.run().unwrap();
        let e = nmse(&s.get_f32(scaled).unwrap(), &s.get_f32(want).unwrap());
        assert!(e < 1e-12, "{name}: nmse {e:e}");
    }
}

#[test]
fn ops_that_cannot_read_blocks_refuse_quantized_inputs_when_built() {
    for dtype in QUANTS {
        let mut g = Graph::new();
        let q = g.parameter("w", dtype, [64, 2, 1, 1]).unwrap();
        let f = g.input("x", F32, [64, 2, 1, 1]).unwrap();
        assert!(g.silu(q).is_err(), "unary on {dtype}");
        assert!(g.add(q, f).is_err(), "binary on {dtype} (lhs)");
        assert!(g.mul(f, q).is_err(), "binary on {dtype} (rhs)");
        assert!(g.scale(q, 2.0).is_err(), "scale on {dtype}");
        assert!(g.rms_norm(q, 1e-6).is_err(), "rms_norm on {dtype}");
        assert!(g.softmax(q, 1.0, None).is_err(), "softmax on {dtype}");
        assert!(g.cont(q).is_err(), "cont on {dtype}");
        assert!(g.cast(q, F32).is_err(), "cast on {dtype}");
        assert!(g.mul_mat(f, q).is_err(), "quantized activations on {dtype}");
        assert!(g.quantize(q, DType::Q8_0).is_err(), "quantize of {dtype}");
        assert!(g.dequantize(f).is_err(), "dequantize of f32");
    }
}

#[test]
fn set_rows_from_a_quantized_source_writes_its_dequantized_rows() {
    for dtype in QUANTS {
        let v = fixed_values(128 * 3);
        let bytes = quantizer_bytes(dtype, &v);
        let rows = host::decode(dtype, &bytes);
        for mut backend in backends() {
            let mut g = Graph::new();
            let dst = g.input("dst", F32, [128, 5, 1, 1]).unwrap();
            let src = g.parameter("src", dtype, [128, 3, 1, 1]).unwrap();
            let ids = g.input("ids", DType::I32, [3, 1, 1, 1]).unwrap();
            let y = g.set_rows(dst, src, ids).unwrap();
            g.mark_output(y).unwrap();
            let mut s = Session::new(&g, backend.as_mut()).unwrap();
            s.set_f32(dst, &vec![7.0; 128 * 5]).unwrap();
            s.set(src, &bytes).unwrap();
            s.set_i32(ids, &[4, 0, 2]).unwrap();
            s.run().unwrap();
            let got = s.get_f64(y).unwrap();
            for (r, want_row) in [(4, 0), (0, 1), (2, 2), (1, usize::MAX), (3, usize::MAX)] {
                let row = &got[r * 128..(r + 1) * 128];
                if want_row == usize::MAX {
                    assert!(row.iter().all(|&x| x == 7.0), "{dtype}: untouched row {r}");
                } else {
                    assert_eq!(row, &rows[want_row * 128..(want_row + 1) * 128], "{dtype}: row {r}");
                }
            }
        }
    }
}
