//! The step graph against a plain host forward pass (f64, one token at a time), written from
//! docs/notes/hybrid-ops.md §2.2 / §4.2 / §5.1 without the graph: checks the layer math itself
//! (interleaved q/gate, q/k norms, NEOX rope, GQA, conv + delta rule with tiled heads, gated norm,
//! softmax routing with renormalised top-k, gated shared expert, tied output).

use std::collections::HashMap;

use tessera_cpu::CpuBackend;
use tessera_models::config::{Ffn, LayerKind, ModelConfig};
use tessera_models::gguf::GgufFile;
use tessera_models::model::{Logits, Model, ModelOptions};
use tessera_models::synth::synthesize;
use tessera_ops::{DType, host};

/// One layer's K and V rows, one per position.
type KvHistory = (Vec<Vec<f64>>, Vec<Vec<f64>>);

struct Reference {
    c: ModelConfig,
    w: HashMap<String, Vec<f64>>,
    /// Per layer: attention K/V history; conv and delta states (used by recurrent layers).
    kv: Vec<KvHistory>,
    conv: Vec<Vec<f64>>,
    delta: Vec<Vec<f64>>,
    pos: usize,
}

fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    let k = x.len();
    w.chunks(k).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms(x: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().map(|v| v * s).collect()
}

fn mul(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x * y).collect()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

impl Reference {
    fn new(c: &ModelConfig, f: &GgufFile) -> Self {
        let w = f
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), host::decode(t.dtype, f.tensor_data(&t.name).unwrap())))
            .collect();
        let n = c.n_main_layers();
        let s = c.ssm.as_ref().expect("a qwen35 config has gated DeltaNet layers");
        Reference {
            c: c.clone(),
            w,
            kv: vec![(Vec::new(), Vec::new()); n],
            conv: vec![vec![0.0; (s.d_conv - 1) * c.ssm_conv_dim()]; n],
            delta: vec![vec![0.0; s.d_state * c.ssm_head_v_dim() * s.dt_rank]; n],
            pos: 0,
        }
    }

    fn w(&self, name: &str) -> &[f64] {
        &self.w[name]
    }

    fn token(&mut self, tok: u32) -> Vec<f64> {
        let c = self.c.clone();
        let e = c.n_embd;
        let eps = c.rms_eps as f64;
        let mut x = self.w("token_embd.weight")[tok as usize * e..(tok as usize + 1) * e].to_vec();
        for il in 0..c.n_main_layers() {
            let p = |s: &str| format!("blk.{il}.{s}");
            let h = mul(&rms(&x, eps), self.w(&p("attn_norm.weight")));
            let m = match c.layer_kind(il) {
                LayerKind::FullAttention => self.attention(il, &h),
                LayerKind::GatedDeltaNet => self.delta_net(il, &h),
            };
            x = x.iter().zip(&m).map(|(a, b)| a + b).collect();
            let h = mul(&rms(&x, eps), self.w(&p("post_attention_norm.weight")));
            let f = self.ffn(il, &h);
            x = x.iter().zip(&f).map(|(a, b)| a + b).collect();
        }
        self.pos += 1;
        let h = mul(&rms(&x, eps), self.w("output_norm.weight"));
        let head = if c.tied_embeddings { "token_embd.weight" } else { "output.weight" };
        matvec(self.w(head), &h)
    }

    fn rope(&self, x: &mut [f64]) {
        // Text positions (p, p, p, 0) with sections covering every pair: plain NEOX (notes §1.4).
        let half = self.c.n_rot / 2;
        for i in 0..half {
            let theta = self.pos as f64 * (self.c.rope_freq_base as f64).powf(-2.0 * i as f64 / self.c.n_rot as f64);
            let (s, co) = theta.sin_cos();
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * co - b * s;
            x[i + half] = a * s + b * co;
        }
    }

    fn attention(&mut self, il: usize, h: &[f64]) -> Vec<f64> {
        let c = self.c.clone();
        let (hd, nh, nkv, eps) = (c.head_dim, c.n_head, c.n_head_kv, c.rms_eps as f64);
        let p = |s: &str| format!("blk.{il}.{s}");
        let qg = matvec(self.w(&p("attn_q.weight")), h);
        let kall = matvec(self.w(&p("attn_k.weight")), h);
        let v = matvec(self.w(&p("attn_v.weight")), h);
        let (qn, kn) = (self.w(&p("attn_q_norm.weight")).to_vec(), self.w(&p("attn_k_norm.weight")).to_vec());
        let mut k = Vec::new();
        for j in 0..nkv {
            let mut kh = mul(&rms(&kall[j * hd..(j + 1) * hd], eps), &kn);
            self.rope(&mut kh);
            k.extend(kh);
        }
        self.kv[il].0.push(k);
        self.kv[il].1.push(v);
        let mut out = Vec::new();
        for i in 0..nh {
            let mut q = mul(&rms(&qg[i * 2 * hd..i * 2 * hd + hd], eps), &qn);
            self.rope(&mut q);
            let gate = &qg[i * 2 * hd + hd..(i + 1) * 2 * hd];
            let j = i / (nh / nkv);
            let scale = 1.0 / (hd as f64).sqrt();
            let s: Vec<f64> = self.kv[il]
                .0
                .iter()
                .map(|kt| scale * q.iter().zip(&kt[j * hd..(j + 1) * hd]).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let ex: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
            let z: f64 = ex.iter().sum();
            let mut o = vec![0.0; hd];
            for (wgt, vt) in ex.iter().zip(&self.kv[il].1) {
                for d in 0..hd {
                    o[d] += wgt / z * vt[j * hd + d];
                }
            }
            out.extend(o.iter().zip(gate).map(|(a, g)| a * sigmoid(*g)));
        }
        matvec(self.w(&p("attn_output.weight")), &out)
    }

    fn delta_net(&mut self, il: usize, h: &[f64]) -> Vec<f64> {
        let c = self.c.clone();
        let s = c.ssm.as_ref().expect("a qwen35 config has gated DeltaNet layers");
        let (hk, hv, sk, sv, dc) = (s.n_group, s.dt_rank, s.d_state, c.ssm_head_v_dim(), s.d_conv);
        let ch = c.ssm_conv_dim();
        let eps = c.rms_eps as f64;
        let p = |s: &str| format!("blk.{il}.{s}");
        let qkv = matvec(self.w(&p("attn_qkv.weight")), h);
        let z = matvec(self.w(&p("attn_gate.weight")), h);
        let beta: Vec<f64> = matvec(self.w(&p("ssm_beta.weight")), h).into_iter().map(sigmoid).collect();
        let alpha = matvec(self.w(&p("ssm_alpha.weight")), h);
        let (dt, a) = (self.w(&p("ssm_dt.bias")).to_vec(), self.w(&p("ssm_a")).to_vec());
        let g: Vec<f64> = (0..hv).map(|i| softplus(alpha[i] + dt[i]) * a[i]).collect();
        let kernel = self.w(&p("ssm_conv1d.weight")).to_vec();
        let st = &mut self.conv[il];
        let mut y = vec![0.0; ch];
        for cc in 0..ch {
            let mut win: Vec<f64> = st[cc * (dc - 1)..(cc + 1) * (dc - 1)].to_vec();
            win.push(qkv[cc]);
            y[cc] = silu((0..dc).map(|i| win[i] * kernel[cc * dc + i]).sum());
            st[cc * (dc - 1)..(cc + 1) * (dc - 1)].copy_from_slice(&win[1..]);
        }
        let l2 = |x: &[f64]| {
            let n = x.iter().map(|v| v * v).sum::<f64>().sqrt().max(eps);
            x.iter().map(|v| v / n).collect::<Vec<f64>>()
        };
        let norm_w = self.w(&p("ssm_norm.weight")).to_vec();
        let s_all = &mut self.delta[il];
        let scale = 1.0 / (sk as f64).sqrt();
        let mut out = Vec::new();
        for hh in 0..hv {
            let kh = hh % hk;
            let q = l2(&y[kh * sk..(kh + 1) * sk]);
            let k = l2(&y[hk * sk + kh * sk..hk * sk + (kh + 1) * sk]);
            let v = &y[2 * hk * sk + hh * sv..2 * hk * sk + (hh + 1) * sv];
            // state[i, j, h] = S[k = i][v = j], element i + sk * (j + sv * h).
            let s = &mut s_all[hh * sk * sv..(hh + 1) * sk * sv];
            let decay = g[hh].exp();
            s.iter_mut().for_each(|x| *x *= decay);
            for j in 0..sv {
                let u: f64 = (0..sk).map(|i| s[i + sk * j] * k[i]).sum();
                let d = beta[hh] * (v[j] - u);
                for i in 0..sk {
                    s[i + sk * j] += k[i] * d;
                }
            }
            let o: Vec<f64> = (0..sv).map(|j| (0..sk).map(|i| s[i + sk * j] * scale * q[i]).sum()).collect();
            let o = mul(&rms(&o, eps), &norm_w);
            out.extend(o.iter().zip(&z[hh * sv..(hh + 1) * sv]).map(|(a, zz)| a * silu(*zz)));
        }
        matvec(self.w(&p("ssm_out.weight")), &out)
    }

    fn ffn(&self, il: usize, h: &[f64]) -> Vec<f64> {
        let p = |s: &str| format!("blk.{il}.{s}");
        let swiglu = |g: Vec<f64>, u: Vec<f64>| g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect::<Vec<f64>>();
        match self.c.ffn {
            Ffn::Dense { .. } => {
                let a = swiglu(matvec(self.w(&p("ffn_gate.weight")), h), matvec(self.w(&p("ffn_up.weight")), h));
                matvec(self.w(&p("ffn_down.weight")), &a)
            }
            Ffn::Moe { n_expert, n_expert_used, n_ff_exp, .. } => {
                let e = self.c.n_embd;
                let logits = matvec(self.w(&p("ffn_gate_inp.weight")), h);
                let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ex: Vec<f64> = logits.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = ex.iter().sum();
                let probs: Vec<f64> = ex.iter().map(|v| v / z).collect();
                let mut order: Vec<usize> = (0..n_expert).collect();
                order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
                let sel = &order[..n_expert_used];
                let wsum: f64 = sel.iter().map(|&i| probs[i]).sum();
                let mut out = vec![0.0; e];
                for &x in sel {
                    let mat = |name: &str, rows: usize, k: usize| {
                        let all = self.w(&p(name));
                        all[x * rows * k..(x + 1) * rows * k].to_vec()
                    };
                    let a = swiglu(
                        matvec(&mat("ffn_gate_exps.weight", n_ff_exp, e), h),
                        matvec(&mat("ffn_up_exps.weight", n_ff_exp, e), h),
                    );
                    let d = matvec(&mat("ffn_down_exps.weight", e, n_ff_exp), &a);
                    for (o, v) in out.iter_mut().zip(d) {
                        *o += probs[x] / wsum * v;
                    }
                }
                let a = swiglu(
                    matvec(self.w(&p("ffn_gate_shexp.weight")), h),
                    matvec(self.w(&p("ffn_up_shexp.weight")), h),
                );
                let sh = matvec(self.w(&p("ffn_down_shexp.weight")), &a);
                let gate = sigmoid(matvec(self.w(&p("ffn_gate_inp_shexp.weight")), h)[0]);
                out.iter().zip(sh).map(|(o, s)| o + gate * s).collect()
            }
        }
    }
}

fn nmse(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    num / den
}

#[test]
fn graph_matches_host_reference() {
    for preset in ["tiny", "tiny-moe"] {
        let c = ModelConfig::preset(preset).unwrap();
        let path = std::env::temp_dir().join(format!("tessera_qwen35_ref_{preset}_{}.gguf", std::process::id()));
        synthesize(&c, DType::F32, 5, &path, None).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let toks: Vec<u32> = vec![3, 141, 59, 26, 53, 58, 97, 93, 238];
        let mut r = Reference::new(&c, &f);
        let want: Vec<Vec<f64>> = toks.iter().map(|&t| r.token(t)).collect();

        let mut be = CpuBackend::new();
        let opts = ModelOptions {
            kv_blocks: 8,
            block_size: 4,
            max_context: 32,
            kv_dtype: DType::F32,
            ..ModelOptions::default()
        };
        let mut m = Model::load(&f, &mut be, opts).unwrap();
        // Prefill 6 tokens (chunked delta rule), then 3 decode steps (serial).
        let v = c.n_vocab;
        let all = m.step(&mut be, &[(0, &toks[..6])], Logits::All).unwrap().remove(0);
        for (t, w) in want[..6].iter().enumerate() {
            let e = nmse(&all[t * v..(t + 1) * v], w);
            assert!(e <= 1e-8, "{preset} prefill token {t}: nmse {e:e}");
        }
        for t in 6..toks.len() {
            let got = m.step(&mut be, &[(0, &toks[t..=t])], Logits::Last).unwrap().remove(0);
            let e = nmse(&got, &want[t]);
            assert!(e <= 1e-8, "{preset} decode token {t}: nmse {e:e}");
        }
        let _ = std::fs::remove_file(&path);
    }
}
