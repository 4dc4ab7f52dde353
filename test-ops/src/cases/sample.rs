//! sample: token ids from logits and per-row settings `(temperature, top_k, top_p, u)`.
//!
//! Logits come in four styles: `lm` (a normal bulk, sd 2, with a handful of tokens 10 to 20 above
//! it: what a language model gives, a top token of about 60%), `flat` (uniform in [-1, 1): the
//! top-k / top-p thresholds fall among tens of thousands of near-equal tokens), `ties` (a few
//! levels, so thresholds and draws meet exact ties) and `special` (rows with -inf, NaN and +inf,
//! and a row that is all -inf). Settings are one combination for every row, or `mixed`: row `r`
//! takes `COMBOS[r % COMBOS.len()]`. `u` is per row random (24 bits), or 0, or the largest f32
//! below 1.
//!
//! **Judge** ([`judge`]): a row passes when its id equals the judge's, or when
//! `tessera_ops::reference::sample_accepts` says the id is the f64 rule's for weight sums
//! perturbed by at most [`TOLERANCE`] of the total they are compared with (the CPU's integer
//! masses differ from the real weights by the f32 rounding of `(l - max) / t`, its exp polynomial
//! and the 2^-40 truncation: about 1e-6 relative at worst). The CUDA backend computes the CPU's
//! integers, so against the CPU it must be exact. The `nmse` column of these cases is the share
//! of rows that passed by the tolerance instead of equality (0 when every id is equal).

use tessera_graph::{Graph, GraphError, Tensor};
use tessera_ops::reference::sample_accepts;

use super::{F32, Mix, sh};
use crate::case::{Case, Generator, Init, InputSpec as In, Layout};
use crate::check::{Comparison, Mismatch};

/// The model's vocabulary (Qwen3.5 / 3.6).
const VOCAB: usize = 248_320;

/// Relative slack of the weight sums at the top-p cut and at the draw.
pub(crate) const TOLERANCE: f64 = 1e-5;

/// `u` draws: random per row, or these fixed values.
const U_RANDOM: f32 = -1.0;
/// The largest f32 below 1.
const U_MAX: f32 = 1.0 - 1.0 / 16_777_216.0;
/// Settings marker: row r takes `COMBOS[r % COMBOS.len()]` with a random u.
const MIXED: f32 = -2.0;

/// `(temperature, top_k, top_p)` combinations of the mixed rows: greedy, top-k 1, plain
/// temperature, top-k 40 / vocab, top-p 0.1 / 0.5 / 0.9 / 0.95 / 0.99, and both.
const COMBOS: [[f32; 3]; 12] = [
    [0.0, 0.0, 1.0],
    [1.0, 0.0, 1.0],
    [0.7, 40.0, 0.9],
    [1.0, 40.0, 1.0],
    [1.0, 0.0, 0.9],
    [1.0, 0.0, 0.1],
    [0.8, 1.0, 1.0],
    [1.5, 0.0, 0.5],
    [1.0, 16_777_216.0, 1.0],
    [0.3, 20.0, 0.95],
    [2.0, 1000.0, 0.99],
    [0.6, 0.0, 0.95],
];

/// Logit styles (`Generator::args[0]` of [`logits`]).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Style {
    Lm,
    Flat,
    Ties,
    Special,
    /// `Lm`, with row 1 all NaN (an error case).
    NanRow,
}

impl Style {
    fn name(self) -> &'static str {
        match self {
            Style::Lm => "lm",
            Style::Flat => "flat",
            Style::Ties => "ties",
            Style::Special => "special",
            Style::NanRow => "nan_row",
        }
    }

    fn code(self) -> f32 {
        self as u8 as f32
    }
}

/// Logits `[n, rows]` of the style `args[0]`.
fn logits(ne: [usize; 4], args: [f32; 4], seed: u64) -> Vec<f32> {
    let (n, rows) = (ne[0], ne[1]);
    let mut g = Mix(seed);
    let style = args[0] as u8;
    let mut out = Vec::with_capacity(n * rows);
    for r in 0..rows {
        let row: Vec<f32> = match style {
            s if s == Style::Lm as u8 || s == Style::NanRow as u8 => {
                let mut v: Vec<f32> = (0..n).map(|_| (0..4).map(|_| g.range(-1.0, 1.0)).sum::<f32>() * 1.732).collect();
                let shift = g.range(-1.0, 1.0);
                for (j, boost) in [20.0, 19.3, 18.2, 17.0, 15.5, 14.0, 12.0, 10.0].into_iter().enumerate() {
                    let i = g.below(n);
                    v[i] = boost + shift * (j as f32 * 0.1);
                }
                if s == Style::NanRow as u8 && r == 1 {
                    v.fill(f32::NAN);
                }
                v
            }
            s if s == Style::Flat as u8 => (0..n).map(|_| g.range(-1.0, 1.0)).collect(),
            s if s == Style::Ties as u8 => (0..n).map(|_| g.below(5) as f32 * 0.5).collect(),
            _ => match r % 4 {
                // A third -inf.
                0 => (0..n).map(|_| if g.below(3) == 0 { f32::NEG_INFINITY } else { g.range(-2.0, 2.0) }).collect(),
                // All -inf: every token equally likely.
                1 => vec![f32::NEG_INFINITY; n],
                // Half NaN, the rest spread (the first stays a number, so the row is usable).
                2 => (0..n).map(|i| if i > 0 && g.below(2) == 0 { f32::NAN } else { g.range(-3.0, 3.0) }).collect(),
                // Two +inf among numbers: they share all the mass.
                _ => {
                    let mut v: Vec<f32> = (0..n).map(|_| g.range(-1.0, 1.0)).collect();
                    v[g.below(n)] = f32::INFINITY;
                    v[g.below(n)] = f32::INFINITY;
                    v
                }
            },
        };
        out.extend(row);
    }
    out
}

/// Settings `[4, rows]`: `args = (temperature, top_k, top_p, u)`, `u` < 0 drawn per row; or
/// `args[0] == MIXED`: the combinations of [`COMBOS`] by row.
fn settings(ne: [usize; 4], args: [f32; 4], seed: u64) -> Vec<f32> {
    let mut g = Mix(seed);
    let mut out = Vec::with_capacity(4 * ne[1]);
    for r in 0..ne[1] {
        let [t, k, p] = if args[0] == MIXED { COMBOS[r % COMBOS.len()] } else { [args[0], args[1], args[2]] };
        let u = if args[0] == MIXED || args[3] < 0.0 { g.unit() } else { args[3] };
        out.extend([t, k, p, u]);
    }
    out
}

/// Settings with one bad value: row `rows - 1` gets `args[1]` as field `args[0]`.
fn bad_settings(ne: [usize; 4], args: [f32; 4], seed: u64) -> Vec<f32> {
    let mut out = settings(ne, [1.0, 40.0, 0.9, U_RANDOM], seed);
    out[4 * (ne[1] - 1) + args[0] as usize] = args[1];
    out
}

/// The judgement described in the module doc.
pub(crate) fn judge(inputs: &[Vec<f64>], got: &[f64], want: &[f64]) -> Comparison {
    if got.len() != want.len() || inputs.len() != 2 || got.is_empty() {
        return Comparison {
            nmse: f64::INFINITY,
            mismatches: vec![Mismatch::Length { got: got.len(), want: want.len() }],
        };
    }
    let (logits, settings) = (&inputs[0], &inputs[1]);
    let rows = got.len();
    let n = logits.len() / rows;
    let (mut by_tolerance, mut bad) = (0usize, Vec::new());
    for r in 0..rows {
        if got[r] == want[r] {
            continue;
        }
        let row = [settings[4 * r], settings[4 * r + 1], settings[4 * r + 2], settings[4 * r + 3]];
        let id = got[r];
        let ok =
            id >= 0.0 && id.fract() == 0.0 && sample_accepts(&logits[r * n..(r + 1) * n], row, id as usize, TOLERANCE);
        if ok {
            by_tolerance += 1;
        } else {
            bad.push(r);
        }
    }
    let mismatches = match bad.first() {
        Some(&first) => vec![Mismatch::Exact { count: bad.len(), first, got: got[first], want: want[first] }],
        None => Vec::new(),
    };
    Comparison { nmse: by_tolerance as f64 / rows as f64, mismatches }
}

fn build(g: &mut Graph, x: &[Tensor]) -> Result<Tensor, GraphError> {
    g.sample(x[0], x[1])
}

/// `t=..,k=..,p=..,u=..` of a settings choice.
fn settings_label(args: [f32; 4]) -> String {
    if args[0] == MIXED {
        return "settings=mixed".into();
    }
    let u = match args[3] {
        u if u < 0.0 => "rand".to_string(),
        U_MAX => "max".to_string(),
        u => format!("{u}"),
    };
    format!("t={},k={},p={},u={u}", args[0], args[1], args[2])
}

/// A case of `rows` rows of `n` logits of `style` with `settings` args.
fn case(n: usize, rows: usize, style: Style, args: [f32; 4]) -> Case {
    let ne = [n, rows, 1, 1];
    Case::new(
        "sample",
        format_args!("n={n},rows={rows},logits={},{}", style.name(), settings_label(args)),
        vec![
            In::new("logits", F32, ne)
                .init(Init::Generated(Generator { f: logits, args: [style.code(), 0.0, 0.0, 0.0] })),
            In::new("settings", F32, [4, rows, 1, 1]).init(Init::Generated(Generator { f: settings, args })),
        ],
        build,
    )
    .with_judge(judge)
}

pub(super) fn cases(out: &mut Vec<Case>) {
    let mixed = [MIXED, 0.0, 0.0, 0.0];
    let one = |t: f32, k: f32, p: f32| [t, k, p, U_RANDOM];
    // Odd small vocabularies, every combination by row.
    for n in [1, 7, 33, 1000] {
        for style in [Style::Lm, Style::Flat, Style::Ties, Style::Special] {
            out.push(case(n, 12, style, mixed));
        }
    }
    // The model's vocabulary: each combination on its own, language-model logits and flat ones
    // (flat rows take the large-selection path on the GPU).
    for style in [Style::Lm, Style::Flat] {
        for [t, k, p] in COMBOS {
            out.push(case(VOCAB, 2, style, one(t, k, p)));
        }
    }
    // u at 0 and just below 1 (the first and the last kept token in index order).
    for u in [0.0, U_MAX] {
        for [t, k, p] in [[1.0, 0.0, 1.0], [0.7, 40.0, 0.9], [1.0, 0.0, 0.9]] {
            out.push(case(VOCAB, 2, Style::Lm, [t, k, p, u]));
            out.push(case(1000, 3, Style::Flat, [t, k, p, u]));
        }
    }
    // Ties at the top-k and top-p cuts, and in the draw.
    for [t, k, p] in [[1.0, 40.0, 1.0], [1.0, 0.0, 0.3], [1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 300.0, 0.6]] {
        out.push(case(1000, 4, Style::Ties, one(t, k, p)));
    }
    out.push(case(VOCAB, 2, Style::Ties, one(1.0, 0.0, 0.9)));
    out.push(case(VOCAB, 4, Style::Special, mixed));
    // Many rows: a batch of 128 sequences with their own settings; 16 at the model's vocabulary.
    for style in [Style::Lm, Style::Flat] {
        out.push(case(4096, 128, style, mixed));
    }
    out.push(case(VOCAB, 16, Style::Lm, mixed));
    // Rows apart in memory (a window of a wider leaf), settings transposed.
    let ne = [1000, 12, 1, 1];
    out.push(
        Case::new(
            "sample",
            "n=1000,rows=12,logits=lm,settings=mixed",
            vec![
                In::new("logits", F32, ne)
                    .layout(Layout::WINDOW)
                    .init(Init::Generated(Generator { f: logits, args: [Style::Lm.code(), 0.0, 0.0, 0.0] })),
                In::new("settings", F32, [4, 12, 1, 1])
                    .layout(Layout::TRANSPOSED)
                    .init(Init::Generated(Generator { f: settings, args: mixed })),
            ],
            build,
        )
        .with_judge(judge),
    );
    // Errors: a bad value in the last row's settings, and a row of NaN logits.
    for (field, value, name) in [
        (0.0, -1.0, "t=-1"),
        (0.0, f32::INFINITY, "t=inf"),
        (1.0, 0.5, "k=0.5"),
        (1.0, -3.0, "k=-3"),
        (2.0, 0.0, "p=0"),
        (2.0, 1.5, "p=1.5"),
        (3.0, 1.0, "u=1"),
        (3.0, f32::NAN, "u=nan"),
    ] {
        out.push(
            Case::new(
                "sample",
                format_args!("n=100,rows=3,logits=lm,bad={name}"),
                vec![
                    In::new("logits", F32, [100, 3, 1, 1])
                        .init(Init::Generated(Generator { f: logits, args: [Style::Lm.code(), 0.0, 0.0, 0.0] })),
                    In::new("settings", F32, [4, 3, 1, 1])
                        .init(Init::Generated(Generator { f: bad_settings, args: [field, value, 0.0, 0.0] })),
                ],
                build,
            )
            .expect_error(),
        );
    }
    out.push(case(100, 3, Style::NanRow, one(1.0, 0.0, 1.0)).expect_error());
}

/// The model's vocabulary at 1, 8, 32 and 128 rows: argmax of the same logits, then sample
/// greedy, with top-k 40 / top-p 0.9 at 0.7, at temperature 1 keeping every token, and top-p 0.9
/// of flat logits (the large-selection path).
pub(super) fn perf_cases() -> Vec<Case> {
    let mut out = Vec::new();
    for rows in [1, 8, 32, 128] {
        let ne = [VOCAB, rows, 1, 1];
        let lm = Init::Generated(Generator { f: logits, args: [Style::Lm.code(), 0.0, 0.0, 0.0] });
        out.push(Case::new(
            "argmax",
            format_args!("type=f32,ne={},logits=lm", sh(ne)),
            vec![In::new("x", F32, ne).init(lm)],
            |g, x| g.argmax(x[0]),
        ));
        for (style, args) in [
            (Style::Lm, [0.0, 0.0, 1.0, 0.0]),
            (Style::Lm, [0.7, 40.0, 0.9, U_RANDOM]),
            (Style::Lm, [1.0, 0.0, 1.0, U_RANDOM]),
            (Style::Flat, [1.0, 0.0, 0.9, U_RANDOM]),
        ] {
            out.push(case(VOCAB, rows, style, args));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::judge;

    #[test]
    fn the_judge_takes_equal_ids_and_boundary_draws_only() {
        // Two rows of two equal logits, temperature 1: u = 0.5 is the boundary between ids 0 and 1.
        let logits = vec![1.0, 1.0, 1.0, 1.0];
        let settings = vec![1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 0.2];
        let inputs = [logits, settings];
        assert!(judge(&inputs, &[1.0, 0.0], &[1.0, 0.0]).ok());
        let c = judge(&inputs, &[0.0, 0.0], &[1.0, 0.0]);
        assert!(c.ok() && c.nmse == 0.5, "{c:?}");
        let c = judge(&inputs, &[1.0, 1.0], &[1.0, 0.0]);
        assert!(!c.ok(), "row 1 draws 0.2 of the mass: id 1 is no boundary pick");
        assert!(!judge(&inputs, &[1.0, 7.0], &[1.0, 0.0]).ok());
        assert!(!judge(&inputs, &[1.0], &[1.0, 0.0]).ok());
    }
}
