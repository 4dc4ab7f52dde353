//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the byte alphabet and merging by rank.
//!
//! Vocabulary strings are written in GPT-2's byte alphabet: every byte 0..=255 is one printable
//! char (the printable Latin-1 bytes stand for themselves, the other 68 bytes are shifted to
//! U+0100..=U+0143), so a token's text maps back to its bytes char by char. Encoding never builds
//! those strings: each byte starts as the id of its one-char token and merges act on id pairs.

use std::collections::BinaryHeap;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The char that stands for `byte` in the byte alphabet.
pub(crate) fn byte_char(byte: u8) -> char {
    let b = u32::from(byte);
    let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    if printable {
        return char::from(byte);
    }
    // The n-th non-printable byte (in byte order) is U+0100 + n.
    let n = (0..b)
        .filter(|&x| !((0x21..=0x7e).contains(&x) || (0xa1..=0xac).contains(&x) || (0xae..=0xff).contains(&x)))
        .count();
    // 256 + n < 0x144 is always a valid char.
    char::from_u32(0x100 + n as u32).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// Char -> byte for the byte alphabet: indexed by code point, `None` outside it.
pub(crate) fn char_to_byte_table() -> Vec<Option<u8>> {
    let mut table = vec![None; 0x144];
    for b in 0..=255u8 {
        table[byte_char(b) as usize] = Some(b);
    }
    table
}

/// The bytes a byte-alphabet string stands for; `None` when a char is outside the alphabet.
pub(crate) fn decode_byte_chars(text: &str, table: &[Option<u8>]) -> Option<Vec<u8>> {
    text.chars().map(|c| table.get(c as usize).copied().flatten()).collect()
}

/// A multiplicative hash for `u64` pair keys: the merge table is hit once per candidate pair,
/// and SipHash would dominate the encoding time.
#[derive(Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (x ^ (x >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 32;
    }
}

/// (left id, right id) packed as `left << 32 | right` -> (rank, merged id).
pub(crate) type MergeTable = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

pub(crate) fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// One symbol of a word being merged: a token id in a doubly linked list over the word.
#[derive(Clone, Copy)]
struct Sym {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

/// A candidate merge: (rank, left position, right position, left id, right id), smallest first.
type Candidate = std::cmp::Reverse<(u32, usize, usize, u32, u32)>;

/// Merges the byte ids of one pre-token and appends the resulting token ids to `out`.
///
/// The pair of lowest rank merges first, the leftmost among equal ranks: a heap of candidate
/// pairs keyed by (rank, left position), entries checked against the current symbols when
/// popped (stale ones are skipped), so a word of n bytes costs O(n log n) even when it is long.
pub(crate) fn merge_word(bytes: &[u8], byte_ids: &[u32; 256], merges: &MergeTable, out: &mut Vec<u32>) {
    match bytes.len() {
        0 => return,
        1 => {
            out.push(byte_ids[bytes[0] as usize]);
            return;
        }
        _ => {}
    }
    let n = bytes.len();
    let mut syms: Vec<Sym> = bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| Sym {
            id: byte_ids[b as usize],
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            alive: true,
        })
        .collect();
    // Min-heap on (rank, left) through Reverse; right and the two ids validate the entry.
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize, r: usize| {
        if let Some(&(rank, _)) = merges.get(&pair_key(syms[l].id, syms[r].id)) {
            heap.push(std::cmp::Reverse((rank, l, r, syms[l].id, syms[r].id)));
        }
    };
    for i in 0..n - 1 {
        push(&mut heap, &syms, i, i + 1);
    }
    while let Some(std::cmp::Reverse((_, l, r, lid, rid))) = heap.pop() {
        let (sl, sr) = (syms[l], syms[r]);
        if !sl.alive || !sr.alive || sl.next != r || sl.id != lid || sr.id != rid {
            continue;
        }
        let Some(&(_, merged)) = merges.get(&pair_key(lid, rid)) else { continue };
        syms[l].id = merged;
        syms[l].next = sr.next;
        syms[r].alive = false;
        if sr.next != NONE {
            syms[sr.next].prev = l;
            push(&mut heap, &syms, l, sr.next);
        }
        if sl.prev != NONE {
            push(&mut heap, &syms, sl.prev, l);
        }
    }
    let mut i = 0;
    while i != NONE {
        out.push(syms[i].id);
        i = syms[i].next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_a_bijection_onto_printable_chars() {
        let table = char_to_byte_table();
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_char(b);
            assert!(!c.is_whitespace() && !c.is_control(), "byte {b:#x} maps to {c:?}");
            assert!(seen.insert(c));
            assert_eq!(table[c as usize], Some(b));
        }
        assert_eq!(byte_char(b' '), 'Ġ');
        assert_eq!(byte_char(b'\n'), 'Ċ');
        assert_eq!(byte_char(b'a'), 'a');
    }

    #[test]
    fn merges_lowest_rank_first_then_leftmost() {
        // Ids: bytes a=0 b=1 c=2; ab=3 bc=4 abc=5 aa=6.
        let mut byte_ids = [u32::MAX; 256];
        byte_ids[b'a' as usize] = 0;
        byte_ids[b'b' as usize] = 1;
        byte_ids[b'c' as usize] = 2;
        let mut merges = MergeTable::default();
        merges.insert(pair_key(1, 2), (0, 4)); // b c -> bc, rank 0
        merges.insert(pair_key(0, 1), (1, 3)); // a b -> ab, rank 1
        merges.insert(pair_key(3, 2), (2, 5)); // ab c -> abc, rank 2
        merges.insert(pair_key(0, 0), (3, 6)); // a a -> aa, rank 3
        let run = |s: &str| {
            let mut out = Vec::new();
            merge_word(s.as_bytes(), &byte_ids, &merges, &mut out);
            out
        };
        // "bc" (rank 0) wins over "ab" (rank 1), and a + bc has no merge.
        assert_eq!(run("abc"), [0, 4]);
        assert_eq!(run("ab"), [3]);
        // Equal ranks: the leftmost pair first.
        assert_eq!(run("aaa"), [6, 0]);
        assert_eq!(run("aaaa"), [6, 6]);
        assert_eq!(run("a"), [0]);
        assert_eq!(run(""), [] as [u32; 0]);
    }
}
