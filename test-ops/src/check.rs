//! Comparing one output of a backend with its judge's: NMSE for floats, exact equality for
//! integers, and a NaN/Inf check that only excuses a non-finite value the judge also produced.

use std::fmt;

/// The normalised mean squared error of `got` against `want`:
/// `sum((got - want)^2) / sum(want^2)`, over positions where both are finite. 0 when both are
/// all zeros, infinite when only `want` is.
pub fn nmse(got: &[f64], want: &[f64]) -> f64 {
    let (mut err, mut norm) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        if g.is_finite() && w.is_finite() {
            err += (g - w) * (g - w);
            norm += w * w;
        }
    }
    if err == 0.0 {
        0.0
    } else if norm == 0.0 {
        f64::INFINITY
    } else {
        err / norm
    }
}

/// What was found comparing one output.
#[derive(Debug, Clone, PartialEq)]
pub enum Mismatch {
    /// The backend produced a NaN or infinity where the judge has something else.
    NonFinite { count: usize, first: usize, got: f64, want: f64 },
    /// The judge produced a non-finite value where the backend has a finite one.
    MissingNonFinite { count: usize, first: usize, got: f64, want: f64 },
    /// Float values too far apart.
    Nmse { nmse: f64, bound: f64 },
    /// Integer values differ (compared exactly).
    Exact { count: usize, first: usize, got: f64, want: f64 },
    /// Different element counts (a harness bug, or a backend returning the wrong shape).
    Length { got: usize, want: usize },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::NonFinite { count, first, got, want } => {
                write!(f, "{count} non-finite values, first at {first}: got {got}, judge {want}")
            }
            Mismatch::MissingNonFinite { count, first, got, want } => {
                write!(f, "{count} values finite where the judge's are not, first at {first}: got {got}, judge {want}")
            }
            Mismatch::Nmse { nmse, bound } => write!(f, "nmse {nmse:.3e} > bound {bound:.0e}"),
            Mismatch::Exact { count, first, got, want } => {
                write!(f, "{count} integer values differ, first at {first}: got {got}, judge {want}")
            }
            Mismatch::Length { got, want } => write!(f, "{got} values, judge has {want}"),
        }
    }
}

/// The result of comparing one output: its NMSE (0 for exact matches) and any mismatches.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub nmse: f64,
    pub mismatches: Vec<Mismatch>,
}

impl Comparison {
    pub fn ok(&self) -> bool {
        self.mismatches.is_empty()
    }
}

/// Compares float values: NaN/Inf positions must agree with the judge, and the NMSE over the
/// finite ones must not exceed `bound`.
pub fn compare_float(got: &[f64], want: &[f64], bound: f64) -> Comparison {
    if got.len() != want.len() {
        return length_mismatch(got, want);
    }
    let mut mismatches = Vec::new();
    let same_non_finite = |g: f64, w: f64| (g.is_nan() && w.is_nan()) || (g.is_infinite() && g == w);
    let bad_got = first_and_count(got, want, |g, w| !g.is_finite() && !same_non_finite(g, w));
    if let Some((count, first)) = bad_got {
        mismatches.push(Mismatch::NonFinite { count, first, got: got[first], want: want[first] });
    }
    let bad_want = first_and_count(got, want, |g, w| g.is_finite() && !w.is_finite());
    if let Some((count, first)) = bad_want {
        mismatches.push(Mismatch::MissingNonFinite { count, first, got: got[first], want: want[first] });
    }
    let e = nmse(got, want);
    // A NaN error (never produced by `nmse`, but cheap to rule out) fails too.
    if e.is_nan() || e > bound {
        mismatches.push(Mismatch::Nmse { nmse: e, bound });
    }
    Comparison { nmse: e, mismatches }
}

/// Compares integer values exactly.
pub fn compare_exact(got: &[f64], want: &[f64]) -> Comparison {
    if got.len() != want.len() {
        return length_mismatch(got, want);
    }
    let mut mismatches = Vec::new();
    if let Some((count, first)) = first_and_count(got, want, |g, w| g != w) {
        mismatches.push(Mismatch::Exact { count, first, got: got[first], want: want[first] });
    }
    Comparison { nmse: 0.0, mismatches }
}

fn length_mismatch(got: &[f64], want: &[f64]) -> Comparison {
    Comparison { nmse: f64::INFINITY, mismatches: vec![Mismatch::Length { got: got.len(), want: want.len() }] }
}

/// How many positions satisfy `bad`, and the first of them.
fn first_and_count(got: &[f64], want: &[f64], bad: impl Fn(f64, f64) -> bool) -> Option<(usize, usize)> {
    let mut found = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if bad(g, w) {
            found = Some(found.map_or((1, i), |(n, first)| (n + 1, first)));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nmse_is_relative_and_zero_for_equal() {
        assert_eq!(nmse(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((nmse(&[1.1, 0.0], &[1.0, 0.0]) - 0.01).abs() < 1e-12);
        assert_eq!(nmse(&[0.0], &[0.0]), 0.0);
        assert_eq!(nmse(&[1.0], &[0.0]), f64::INFINITY);
    }

    #[test]
    fn non_finite_must_match_the_judge() {
        let inf = f64::INFINITY;
        assert!(compare_float(&[0.0, -inf], &[0.0, -inf], 1e-7).ok());
        assert!(compare_float(&[f64::NAN], &[f64::NAN], 1e-7).ok());
        let c = compare_float(&[f64::NAN, 1.0], &[0.5, 1.0], 1e-7);
        assert!(matches!(c.mismatches[..], [Mismatch::NonFinite { count: 1, first: 0, .. }]));
        let c = compare_float(&[0.0, 1.0], &[-inf, 1.0], 1e-7);
        assert!(matches!(c.mismatches[..], [Mismatch::MissingNonFinite { count: 1, first: 0, .. }]));
    }

    #[test]
    fn nmse_bound_and_exact_compare() {
        assert!(!compare_float(&[1.01], &[1.0], 1e-7).ok());
        assert!(compare_float(&[1.0 + 1e-5], &[1.0], 1e-7).ok());
        let c = compare_exact(&[1.0, 2.0, 4.0], &[1.0, 3.0, 5.0]);
        assert!(matches!(c.mismatches[..], [Mismatch::Exact { count: 2, first: 1, .. }]));
        assert!(!compare_exact(&[1.0], &[1.0, 2.0]).ok());
    }
}
