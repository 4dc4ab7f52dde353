//! Eval cases for the rope family (being written).

use crate::case::Case;

pub(crate) fn cases(_out: &mut Vec<Case>) {}
