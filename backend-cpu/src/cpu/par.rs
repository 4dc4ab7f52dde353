//! When the kernels split work over rayon, and when they run it serially on the current thread.
//!
//! At decode sizes an op is a few hundred nanoseconds of arithmetic, about what handing a loop to
//! rayon costs (splitting, `join`, per-task scratch), so every parallel loop of the backend goes
//! through these helpers: a loop runs serially, with one scratch state, when it has at most one
//! task's worth of items, when the pool has one thread, or when the backend runs the task list
//! serially on the calling thread ([`serially`]: a one-thread backend does not hand its steps to a
//! pool worker, which cost a futex round trip per step). The split never changes results: every
//! kernel computes each output element the same way whatever task computes it.

use std::cell::Cell;

use rayon::prelude::*;

thread_local! {
    /// Set while [`serially`] runs a closure on this thread.
    static SERIAL: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every parallel loop of the backend serial on this thread (no rayon calls, which
/// from outside a pool would each be injected into the pool and wait for it).
pub(crate) fn serially<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SERIAL.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SERIAL.with(|s| s.replace(true)));
    f()
}

/// Threads a kernel may spread work over: 1 inside [`serially`].
pub(crate) fn threads() -> usize {
    if SERIAL.with(Cell::get) { 1 } else { rayon::current_num_threads() }
}

/// True when `items` items, at least `min_len` per task, are worth splitting.
pub(crate) fn split(items: usize, min_len: usize) -> bool {
    items > min_len.max(1) && threads() > 1
}

/// Calls `f(state, i)` for every `i < n`, in parallel tasks of at least `min_len` items when that
/// is worth it; `init` makes each task's scratch state.
pub(crate) fn for_each_init<S>(
    n: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize) + Sync + Send,
) {
    if split(n, min_len) {
        (0..n).into_par_iter().with_min_len(min_len.max(1)).for_each_init(init, f);
    } else {
        let mut s = init();
        (0..n).for_each(|i| f(&mut s, i));
    }
}

/// Calls `f(state, i, chunk)` for chunk `i` of `data` (chunks of `size`, the last maybe shorter),
/// in parallel tasks of at least `min_len` chunks when that is worth it.
pub(crate) fn chunks_mut<T: Send, S>(
    data: &mut [T],
    size: usize,
    min_len: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &mut [T]) + Sync + Send,
) {
    let size = size.max(1);
    if split(data.len().div_ceil(size), min_len) {
        data.par_chunks_mut(size).enumerate().with_min_len(min_len.max(1)).for_each_init(init, |s, (i, c)| f(s, i, c));
    } else {
        let mut s = init();
        data.chunks_mut(size).enumerate().for_each(|(i, c)| f(&mut s, i, c));
    }
}

/// `(0..n).map(f)` collected in order, in parallel tasks of at least `min_len` items when that is
/// worth it; stops at the first error.
pub(crate) fn try_map<T: Send, E: Send>(
    n: usize,
    min_len: usize,
    f: impl Fn(usize) -> Result<T, E> + Sync + Send,
) -> Result<Vec<T>, E> {
    if split(n, min_len) {
        (0..n).into_par_iter().with_min_len(min_len.max(1)).map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}
