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
}

/// The state slot of each sequence, checked in sequence order: a value outside `0..n_slots` is
/// [`KernelError::IndexOutOfRange`], a slot named twice is [`KernelError::DuplicateIndex`]. Every
/// backend checks slots with this before writing any state, so all report the same first error.
pub fn checked_slots(
    op: &'static str,
    slots: impl IntoIterator<Item = i64>,
    n_slots: usize,
) -> Result<Vec<usize>, KernelError> {
    let mut owner: Vec<Option<usize>> = vec![None; n_slots];
    let mut out = Vec::new();
    for (s, v) in slots.into_iter().enumerate() {
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
        out.push(k);
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
}
