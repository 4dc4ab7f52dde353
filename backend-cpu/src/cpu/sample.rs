//! sample: one token id per row of logits, by `tessera_ops::sample::sample` (the exact integer
//! rule that every backend and the host sampler share), rows in parallel.
//!
//! Every row's settings are checked first (row order), then every row's logits (a row of NaNs
//! is an error); the first bad row is the error and nothing is written.

use tessera_ops::KernelError;
use tessera_ops::sample::{BadSetting, SampleField, SampleSettings, sample as sample_row};

use super::par;
use super::strided::{Dst, Src};

fn bad_value(row: usize, bad: BadSetting) -> KernelError {
    KernelError::BadValue {
        op: "sample",
        row,
        what: bad.field.name(),
        value: f64::from(bad.value),
        expected: bad.field.expected(),
    }
}

/// `logits` f32 `[n_vocab, n_rows, 1, 1]`, `settings` f32 `[4, n_rows, 1, 1]` -> i32
/// `[1, n_rows, 1, 1]`.
pub(super) fn sample(logits: Src<'_>, settings: Src<'_>, dst: &mut Dst<'_>) -> Result<(), KernelError> {
    let [n, rows, ..] = logits.ne();
    let parsed = (0..rows)
        .map(|r| {
            let mut row = [0.0f32; 4];
            settings.load_row([r, 0, 0], &mut row);
            SampleSettings::from_row(row).map_err(|b| bad_value(r, b))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let picks = par::try_map(rows, 1, |r| {
        let mut scratch = Vec::new();
        let xs = match logits.row_f32([r, 0, 0]) {
            Some(xs) => xs,
            None => {
                scratch.resize(n, 0.0);
                logits.load_row([r, 0, 0], &mut scratch);
                &scratch[..]
            }
        };
        Ok::<_, KernelError>(sample_row(xs, &parsed[r]))
    })?;
    if let Some(r) = picks.iter().position(Option::is_none) {
        return Err(bad_value(r, BadSetting { field: SampleField::Logits, value: f32::NAN }));
    }
    dst.for_each_row(
        n,
        || (),
        |_, r, mut row| {
            // Picks are below n_vocab < 2^24.
            row.store_i32(&[picks[r].map_or(0, |p| p as i32)]);
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::cpu::testutil::{F32, check};

    #[test]
    fn sample_matches_the_reference_on_simple_rows() {
        // Rows without draws near a boundary: the CPU's integer masses give the reference's picks.
        check(90, 0.0, |g, l| {
            let nan = f64::NAN;
            let x = l.values(
                g.input("x", F32, [5, 4, 1, 1])?,
                vec![2., 3., 0., 3., 1., 1., 1., 1., 1., 1., nan, 5., nan, -1., 0., 0., 0., 0., 0., 0.],
            );
            let s = l.values(
                g.input("s", F32, [4, 4, 1, 1])?,
                vec![1., 2., 1., 0.9, 1., 0., 1., 0.3, 0., 0., 1., 0.5, 1., 0., 0.5, 0.99],
            );
            Ok(vec![g.sample(x, s)?])
        });
    }
}
