//! Errors that only the data can reveal (an op that was valid to build but got bad values).

/// A failure while computing an op, found in its input values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error("{op}: index {index} is out of range 0..{limit} ({what})")]
    IndexOutOfRange { op: &'static str, index: i64, limit: usize, what: &'static str },

    #[error("{op}: {what} {index} is named by both sequence {first} and sequence {second}; each needs its own")]
    DuplicateIndex { op: &'static str, index: usize, first: usize, second: usize, what: &'static str },

    #[error("{op}: not supported here: {why}")]
    Unsupported { op: &'static str, why: String },

    /// A value outside the range its position allows: `what[at] = value` is not in `low..=high`
    /// (e.g. a ragged batch's `seq_offsets`, which must be non-decreasing and at most n_tokens).
    #[error("{op}: {what}[{at}] = {value} is outside {low}..={high}")]
    ValueOutOfRange { op: &'static str, what: &'static str, at: usize, value: i64, low: i64, high: i64 },

    /// A float value of row `row` outside its range (e.g. sample's settings), or a row with no
    /// usable value (sample's logits all NaN).
    #[error("{op}: row {row}: {what} is {value}, expected {expected}")]
    BadValue { op: &'static str, row: usize, what: &'static str, value: f64, expected: &'static str },
}

impl KernelError {
    /// The same error reported by `fused`: a fused op that runs another op's kernel (or
    /// reference) as a step of its composition names itself in that step's errors.
    pub fn in_op(self, fused: &'static str) -> KernelError {
        use KernelError as E;
        match self {
            E::IndexOutOfRange { index, limit, what, .. } => E::IndexOutOfRange { op: fused, index, limit, what },
            E::DuplicateIndex { index, first, second, what, .. } => {
                E::DuplicateIndex { op: fused, index, first, second, what }
            }
            E::Unsupported { why, .. } => E::Unsupported { op: fused, why },
            E::ValueOutOfRange { what, at, value, low, high, .. } => {
                E::ValueOutOfRange { op: fused, what, at, value, low, high }
            }
            E::BadValue { row, what, value, expected, .. } => E::BadValue { op: fused, row, what, value, expected },
        }
    }
}

/// The `seq_offsets` of a ragged token batch (`n_seq + 1` values; sequence `s` owns tokens
/// `offsets[s] .. offsets[s + 1]`), checked in order: each value must lie in
/// `previous..=n_tokens` (the first in `0..=n_tokens`), else [`KernelError::ValueOutOfRange`]
/// names the first bad one. Every backend checks offsets with this (or its device twin
/// `check_seq_offsets` in backend-cuda's common.cuh) before writing anything.
pub fn checked_seq_offsets(
    op: &'static str,
    offsets: impl IntoIterator<Item = i64>,
    n_tokens: usize,
) -> Result<Vec<usize>, KernelError> {
    let mut out: Vec<usize> = Vec::new();
    for (at, value) in offsets.into_iter().enumerate() {
        let low = out.last().map_or(0, |&o| o as i64);
        if value < low || value > n_tokens as i64 {
            return Err(KernelError::ValueOutOfRange {
                op,
                what: "seq_offsets",
                at,
                value,
                low,
                high: n_tokens as i64,
            });
        }
        out.push(value as usize);
    }
    Ok(out)
}

/// The state slot of each sequence of a ragged batch whose checked `seq_offsets` are `offsets`
/// (from [`checked_seq_offsets`]): `None` for a sequence with no tokens, whose slot is not read,
/// written or checked; the slots of the sequences with tokens are checked as [`checked_slots`]
/// checks them (in range, distinct among themselves), in sequence order. Device twin:
/// `check_ragged_state_slots` in backend-cuda's common.cuh.
pub fn checked_ragged_slots(
    op: &'static str,
    slots: impl IntoIterator<Item = i64>,
    offsets: &[usize],
    n_slots: usize,
) -> Result<Vec<Option<usize>>, KernelError> {
    let slots = slots.into_iter().zip(offsets.windows(2)).map(|(v, w)| (w[0] < w[1]).then_some(v));
    checked_slots_of(op, slots, n_slots)
}

/// The state slot of each sequence, checked in sequence order: a value outside `0..n_slots` is
/// [`KernelError::IndexOutOfRange`], a slot named twice is [`KernelError::DuplicateIndex`]. Every
/// backend checks slots with this before writing any state, so all report the same first error.
pub fn checked_slots(
    op: &'static str,
    slots: impl IntoIterator<Item = i64>,
    n_slots: usize,
) -> Result<Vec<usize>, KernelError> {
    let slots = checked_slots_of(op, slots.into_iter().map(Some), n_slots)?;
    Ok(slots.into_iter().flatten().collect())
}

/// [`checked_slots`] over the sequences whose slot is `Some`; `None` entries are skipped.
fn checked_slots_of(
    op: &'static str,
    slots: impl IntoIterator<Item = Option<i64>>,
    n_slots: usize,
) -> Result<Vec<Option<usize>>, KernelError> {
    let mut owner: Vec<Option<usize>> = vec![None; n_slots];
    let mut out = Vec::new();
    for (s, v) in slots.into_iter().enumerate() {
        let Some(v) = v else {
            out.push(None);
            continue;
        };
        let k = usize::try_from(v).ok().filter(|&k| k < n_slots).ok_or(KernelError::IndexOutOfRange {
            op,
            index: v,
            limit: n_slots,
            what: "state slot",
        })?;
        if let Some(first) = owner[k] {
            return Err(KernelError::DuplicateIndex { op, index: k, first, second: s, what: "state slot" });
        }
        owner[k] = Some(s);
        out.push(Some(k));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_must_be_in_range_and_distinct() {
        assert_eq!(checked_slots("t", [2, 0, 1], 3), Ok(vec![2, 0, 1]));
        assert!(matches!(checked_slots("t", [3], 3), Err(KernelError::IndexOutOfRange { index: 3, .. })));
        assert!(matches!(checked_slots("t", [-1], 3), Err(KernelError::IndexOutOfRange { index: -1, .. })));
        let e = checked_slots("t", [1, 0, 1], 3).unwrap_err();
        assert_eq!(e, KernelError::DuplicateIndex { op: "t", index: 1, first: 0, second: 2, what: "state slot" });
        assert!(e.to_string().contains("state slot 1 is named by both sequence 0 and sequence 2"), "{e}");
    }

    #[test]
    fn seq_offsets_must_be_non_decreasing_and_within_n_tokens() {
        assert_eq!(checked_seq_offsets("t", [0, 3, 3, 7], 9), Ok(vec![0, 3, 3, 7]));
        assert_eq!(checked_seq_offsets("t", [2, 9], 9), Ok(vec![2, 9]));
        let bad = |o: &[i64]| checked_seq_offsets("t", o.iter().copied(), 9).unwrap_err();
        let e = bad(&[0, 5, 4, 9]);
        assert_eq!(e, KernelError::ValueOutOfRange { op: "t", what: "seq_offsets", at: 2, value: 4, low: 5, high: 9 });
        assert!(e.to_string().contains("seq_offsets[2] = 4 is outside 5..=9"), "{e}");
        assert!(matches!(bad(&[-1, 2]), KernelError::ValueOutOfRange { at: 0, value: -1, low: 0, .. }));
        assert!(matches!(bad(&[0, 10]), KernelError::ValueOutOfRange { at: 1, value: 10, high: 9, .. }));
    }

    #[test]
    fn ragged_slots_skip_empty_sequences() {
        let offsets = [0, 2, 2, 3, 3];
        // Empty sequences may name anything, even a slot another sequence uses or none at all.
        assert_eq!(checked_ragged_slots("t", [1, 1, 0, -5], &offsets, 2), Ok(vec![Some(1), None, Some(0), None]));
        let e = checked_ragged_slots("t", [1, 0, 1, 0], &offsets, 2).unwrap_err();
        assert_eq!(e, KernelError::DuplicateIndex { op: "t", index: 1, first: 0, second: 2, what: "state slot" });
        let e = checked_ragged_slots("t", [0, 0, 2, 0], &offsets, 2).unwrap_err();
        assert!(matches!(e, KernelError::IndexOutOfRange { index: 2, limit: 2, .. }), "{e}");
    }
}
